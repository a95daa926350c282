"""The CUDA backend's Triton kernels run by Triton's interpreter on CPU tensors (numpy does the
tensor-core products), so CI checks their logic without a GPU: the leaf tree of the GEMM, the
masks and paging of attention, the grouped MoE schedule, the per-row kernels.

Run as a script with TRITON_INTERPRET=1 set before Triton is imported (the test does this in a
subprocess, so it never leaks into a GPU run); prints one line per check: `name ok` or
`name FAIL detail`. Inside the interpreter the products are numpy matmuls on fixed tile shapes,
so row independence holds there as it does on the GPU and the invariances can be compared bit
for bit; the comparisons with the CPU backend use a tolerance (different arithmetic).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from onpolicy.kernels.cpu import attention as cpu_attention  # noqa: E402
from onpolicy.kernels.cpu import linear as cpu_linear  # noqa: E402
from onpolicy.kernels.cpu import logprob as cpu_logprob  # noqa: E402
from onpolicy.kernels.cpu import moe as cpu_moe  # noqa: E402
from onpolicy.kernels.cpu import norm as cpu_norm  # noqa: E402
from onpolicy.kernels.cpu import rope as cpu_rope  # noqa: E402
from onpolicy.kernels.cuda import attention, elementwise, linear, logprob, moe  # noqa: E402
from onpolicy.kernels.rules import K_BLOCK, MMA_LEAF  # noqa: E402
from onpolicy.kernels.tree import pairwise_tree_sum  # noqa: E402

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def wide(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
    assert err < tol, f"relative max error {err:.2e} >= {tol:.0e}"


@check
def gemm_leaves_sum_by_the_pairwise_tree() -> None:
    """One 64 x 64 tile: each leaf is its 128-wide chunks chained into one accumulator, and
    the leaves are added by `pairwise_tree_sum`, not left to right."""
    for leaves in (1, 2, 3, 5, 6, 7, 8, 11):
        k = MMA_LEAF * leaves
        x, w = wide(64, k, seed=leaves), torch.randn(64, k)
        got = linear.tree_mm(x, w)
        parts = []
        for leaf in range(leaves):
            c = np.zeros((64, 64), np.float32)
            for lo in range(leaf * MMA_LEAF, (leaf + 1) * MMA_LEAF, K_BLOCK):
                c = c + np.matmul(
                    x[:, lo : lo + K_BLOCK].numpy(), w[:, lo : lo + K_BLOCK].T.numpy()
                )
            parts.append(torch.from_numpy(c))
        assert torch.equal(got, pairwise_tree_sum(parts)), f"{leaves} leaves: not the tree"
        if leaves >= 5:
            seq = sum(parts[1:], parts[0])
            assert not torch.equal(got, seq), f"{leaves} leaves: left to right gives the same bits"


@check
def gemm_rows_are_independent_of_the_batch() -> None:
    x, w = wide(100, 1100, seed=1), wide(70, 1100, seed=2)
    full = linear.linear(x, w)
    for i in (0, 63, 64, 99):
        assert torch.equal(linear.linear(x[i : i + 1], w)[0], full[i]), f"row {i}"
    close(full, cpu_linear.linear(x, w), 1e-5)


@check
def gemm_shards_of_whole_leaves_are_exact() -> None:
    x, w = wide(9, 4 * MMA_LEAF, seed=3), wide(20, 4 * MMA_LEAF, seed=4)
    for tp in (2, 4):
        assert torch.equal(linear.row_parallel_linear(x, w, tp), linear.linear(x, w)), tp


@check
def attention_decode_and_chunks_equal_packed_prefill() -> None:
    hq, hkv, d, n, page = 4, 2, 16, 150, 8
    q, k, v = wide(n, hq, d, seed=5), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    full = attention.attention(q, k, v, [0, n])
    close(full, cpu_attention.attention(q, k, v, [0, n]), 1e-4)
    pages = -(-n // page)
    table = torch.randperm(pages + 5)[:pages]
    kp = torch.full((pages + 5, page, hkv, d), float("nan"))
    vp = torch.full((pages + 5, page, hkv, d), float("nan"))
    pos = torch.arange(n)
    kp[table[pos // page], pos % page], vp[table[pos // page], pos % page] = k, v
    for chunk in (1, 7, 64, 150):
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            got = attention.paged_attention(q[lo:hi], kp, vp, [0, hi - lo], [table], [hi])
            assert torch.equal(got, full[lo:hi]), f"chunk {chunk} at {lo}"


@check
def packed_sequences_do_not_see_each_other() -> None:
    q, k, v = wide(80, 4, 16, seed=6), torch.randn(80, 2, 16), torch.randn(80, 2, 16)
    packed = attention.attention(q, k, v, [0, 5, 75, 80])
    alone = attention.attention(q[5:75], k[5:75], v[5:75], [0, 70])
    assert torch.equal(packed[5:75], alone)


@check
def moe_grouped_rows_equal_linear_per_expert() -> None:
    e, h, i, t, top = 8, 256, 64, 40, 2
    x, gate = wide(t, h, seed=7), torch.randn(e, h)
    wg, wu, wd = (
        torch.randn(e, i, h) * 0.1,
        torch.randn(e, i, h) * 0.1,
        torch.randn(e, h, i) * 0.1,
    )
    ids, weights = moe.route(x, gate, top)
    out = moe.expert_outputs(x, ids, wg, wu, wd)
    for tok in (0, 17, 39):
        for s in range(top):
            ex = int(ids[tok, s])
            hid = elementwise.silu_mul(linear.linear(x[tok : tok + 1], wg[ex]),
                                       linear.linear(x[tok : tok + 1], wu[ex]))  # fmt: skip
            assert torch.equal(out[tok, s], linear.linear(hid, wd[ex])[0]), (tok, s)
    local = moe.expert_outputs(x, ids, wg, wu, wd, local_experts=[1, 4])
    mask = torch.isin(ids, torch.tensor([1, 4]))
    assert torch.equal(local[mask], out[mask]) and not local[~mask].any()
    close(moe.moe(x, gate, wg, wu, wd, top), cpu_moe.moe(x, gate, wg, wu, wd, top), 1e-4)


@check
def row_kernels_are_row_independent_and_match_the_cpu_backend() -> None:
    x, r, wn = wide(7, 3, 96, seed=8), wide(7, 3, 96, seed=9), torch.randn(96)
    normed, res = elementwise.rms_norm(x, wn, 1e-6, r)
    assert torch.equal(normed[4], elementwise.rms_norm(x[4], wn, 1e-6, r[4])[0])
    close(normed, cpu_norm.rms_norm(x, wn, 1e-6, r)[0], 1e-5)
    assert torch.equal(res, cpu_norm.rms_norm(x, wn, 1e-6, r)[1])
    table = cpu_rope.rope_table(16, 1e6, 64)
    q, p = wide(5, 3, 16, seed=10), torch.tensor([0, 9, 63, 2, 9])
    close(elementwise.rope(q, p, table), cpu_rope.rope(q, p, table), 1e-6)
    ids, emb = torch.tensor([3, 0, 49]), torch.randn(50, 33)
    assert torch.equal(elementwise.embedding(ids, emb), emb[ids])


@check
def logprobs_vocab_parallel_equal_full() -> None:
    logits, tok = wide(6, 4096, seed=11), torch.randint(0, 4096, (6,))
    full = logprob.token_logprobs(logits, tok, 0.7)
    close(full, cpu_logprob.token_logprobs(logits, tok, 0.7), 1e-5)
    for tp in (2, 4, 8):
        shards = list(logits.chunk(tp, -1))
        assert torch.equal(logprob.vocab_parallel_token_logprobs(shards, tok, 0.7), full), tp


if __name__ == "__main__":
    for name, fn in CHECKS.items():
        try:
            fn()
            print(f"{name} ok", flush=True)
        except Exception as e:  # report every check, not just the first failure
            print(f"{name} FAIL {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    sys.exit(0)
