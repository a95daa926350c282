"""`native_ops()`: every op resolves to the plain torch baseline (`kernels.native`), which agrees
with the exact op within float tolerance (fp32 inputs), and the exact backend is back on exit,
also when the body raises."""

from __future__ import annotations

import pytest
import torch
from onpolicy import kernels as K
from onpolicy.bits import bitwise_equal, n_differ
from onpolicy.kernels import native
from onpolicy.kernels.cpu import linear as cpu_linear

TOL = {"rtol": 1e-4, "atol": 1e-5}
T, H, HQ, HKV, D, E, TOP, INTER, V = 13, 48, 4, 2, 16, 8, 3, 24, 40


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def pages(n_pages: int, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(n_pages, page, HKV, D, seed=seed), randn(n_pages, page, HKV, D, seed=seed + 1)


def moe_weights(seed: int) -> tuple[torch.Tensor, ...]:
    return (randn(E, H, seed=seed), randn(E, INTER, H, seed=seed + 1, scale=H**-0.5),
            randn(E, INTER, H, seed=seed + 2, scale=H**-0.5),
            randn(E, H, INTER, seed=seed + 3, scale=INTER**-0.5))  # fmt: skip


def _paged_case():
    """Two requests over a shuffled paged cache: a 5-token chunk at 9..13, one decode token."""
    k_pages, v_pages = pages(12, 4, seed=7)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(8))
    tables = [perm[:4], perm[4:]]
    return randn(6, HQ, D, seed=9), k_pages, v_pages, K.PagedBatch([0, 5, 6], tables, [14, 30])


def _routed():
    x, (gate, wg, wu, wd) = randn(T, H, seed=10), moe_weights(11)
    ids, _ = K.moe_route(x, gate, TOP)
    return x, ids, wg, wu, wd


CASES = {
    "linear": lambda: K.linear(randn(T, 300, seed=0), randn(20, 300, seed=1), randn(20, seed=2)),
    "linear_partial": lambda: K.linear_partial(randn(T, 256, seed=0), randn(20, 256, seed=1)),
    "row_parallel_linear": lambda: K.row_parallel_linear(
        randn(T, 256, seed=0), randn(20, 256, seed=1), 4, randn(20, seed=2)),
    "rms_norm": lambda: K.rms_norm(randn(T, H, seed=0), randn(H, seed=1), 1e-6),
    "rms_norm_residual": lambda: K.rms_norm(
        randn(T, H, seed=0), randn(H, seed=1), 1e-6, randn(T, H, seed=2)),
    "rope": lambda: K.rope(randn(T, HQ, D, seed=0), torch.arange(5, 5 + T),
                           K.rope_table(D, 10000.0, 64)),
    "silu_mul": lambda: K.silu_mul(randn(T, H, seed=0), randn(T, H, seed=1)),
    "embedding": lambda: K.embedding(torch.tensor([3, 0, 7, 3]), randn(V, H, seed=0)),
    "attention": lambda: K.attention(randn(T, HQ, D, seed=0), randn(T, HKV, D, seed=1),
                                     randn(T, HKV, D, seed=2), [0, 4, 5, T]),
    "paged_attention": lambda: K.paged_attention(*_paged_case()),
    "log_softmax": lambda: K.log_softmax(randn(T, V, seed=0, scale=4.0)),
    "token_logprobs": lambda: K.token_logprobs(
        randn(T, V, seed=0, scale=4.0), torch.arange(T) % V, 0.7),
    "vocab_parallel_token_logprobs": lambda: K.vocab_parallel_token_logprobs(
        randn(T, V, seed=0, scale=4.0).chunk(2, dim=-1), torch.arange(T) * 3 % V),
    "sumexp_partial": lambda: K.sumexp_partial(
        randn(T, V, seed=0, scale=4.0), randn(T, V, seed=0, scale=4.0).amax(-1), 8),
    "route": lambda: K.moe_route(randn(T, H, seed=0), randn(E, H, seed=1), TOP),
    "expert_outputs": lambda: K.moe_expert_outputs(*_routed()),
    "expert_outputs_local": lambda: K.moe_expert_outputs(*_routed(), local_experts=[1, 4, 6]),
    "merge_expert_parallel": lambda: K.moe_merge_expert_parallel(
        [randn(T, TOP, H, seed=r) for r in range(2)], _routed()[1], torch.arange(E) % 2),
    "combine": lambda: K.moe_combine(randn(T, TOP, H, seed=0), _routed()[1],
                                     torch.rand(T, TOP, generator=torch.Generator())),
    "moe": lambda: K.moe(randn(T, H, seed=0), *moe_weights(1), TOP),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_native_op_is_close_to_the_exact_op(name):
    exact = CASES[name]()
    with K.native_ops():
        got = CASES[name]()
    torch.testing.assert_close(got, exact, **TOL)


def test_every_public_op_resolves_to_its_native_primitive():
    x = torch.zeros(1)
    with K.native_ops():
        assert all(K._impl(op, x) is getattr(native, name) for op, name in K._OPS.items())


def test_native_ops_restores_the_exact_backend_on_exit_and_on_exception():
    x = torch.zeros(1)
    with K.native_ops():
        with K.native_ops():
            assert K._impl("linear", x) is native.linear
        assert K._impl("linear", x) is native.linear
    assert K._impl("linear", x) is cpu_linear.linear
    with pytest.raises(RuntimeError, match="boom"), K.native_ops():
        raise RuntimeError("boom")
    assert K._impl("linear", x) is cpu_linear.linear


def test_native_differs_from_exact_somewhere():
    """Negative control: BLAS sums K in its own order, so its fp32 bits are not the tree's."""
    x, w = randn(64, 4096, seed=0), randn(64, 4096, seed=1)
    exact = K.linear(x, w)
    with K.native_ops():
        got = K.linear(x, w)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-3)
    assert not bitwise_equal(got, exact)
    assert n_differ(got, exact) > got.numel() // 2


def test_reference_model_runs_under_native_ops(tiny_checkpoint):
    """The whole model, packed and paged, through the baseline: close to the exact run."""
    from onpolicy.models.reference import Qwen3MoeReference

    model = Qwen3MoeReference.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    seqs = [[5, 17, 3, 99, 42, 7], [1, 2, 3]]
    exact = model.score(seqs)
    exact_gen = model.generate([[5, 17, 3], [8]], max_new_tokens=4, temperature=0.0)
    with K.native_ops():
        got = model.score(seqs)
        got_gen = model.generate([[5, 17, 3], [8]], max_new_tokens=4, temperature=0.0)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    assert [r.output for r in got_gen] == [r.output for r in exact_gen]
    torch.testing.assert_close([r.logprobs for r in got_gen], [r.logprobs for r in exact_gen],
                               rtol=1e-4, atol=1e-4)  # fmt: skip
