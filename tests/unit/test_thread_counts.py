"""Thread-count invariance: every exact CPU op, and the reference model, gives the same bits at
torch.set_num_threads 1, 2 and 4.

Sizes are above torch's intra-op grain (at::internal::GRAIN_SIZE, 32768 elements), so torch
does split the work across threads: a single long row (one output, a long reduction) and a big
batch (many outputs). The exact ops only use elementwise arithmetic, max, sort and gathers,
whose per-element results do not depend on how torch cuts the range into thread chunks.

Negative controls, in the same harness: a plain torch reduction over a single long row is
split across threads and combined, so its bits change with the thread count (`x.sum()`, and the
native rms_norm's mean square); the native silu_mul (`F.silu`) computes the tail of each thread
chunk with a scalar formula that differs from the vector one in the last bit, so on values
where the two formulas disagree its bits move with the chunk boundaries.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from adversarial import mismatch_report, num_threads, wide
from onpolicy import kernels as K
from onpolicy.bits import as_bits, bitwise_equal

THREADS = (1, 2, 4)
GRAIN = 32768
"""at::internal::GRAIN_SIZE: below this many elements torch runs an op on one thread."""


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def thread_reports(fn: Callable[[], object], threads=THREADS) -> list[str]:
    """fn() at each thread count against its 1-thread bits; one report per output that differs
    (empty: the same bits at every count)."""
    with num_threads(threads[0]):
        base = _flat(fn())
    reports = []
    for n in threads[1:]:
        with num_threads(n):
            got = _flat(fn())
        for i, (a, b) in enumerate(zip(base, got, strict=True)):
            if not bitwise_equal(a, b):
                reports.append(f"{n} threads, output {i}: {mismatch_report(a, b)}")
    return reports


def g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the cases: each builds its inputs once and returns a thunk -------------------------------
def _linear_long_row():
    x, w, b = wide(1, 1 << 16, seed=1), wide(8, 1 << 16, seed=2, spread=4), wide(8, seed=3)
    return lambda: K.linear(x, w, b)


def _linear_batch(dtype):
    # 100 rows of K = 640 (5 blocks), N = 160: rows are cut into chunks of 40 (4M products).
    x = wide(100, 640, seed=4, dtype=dtype)
    w = wide(160, 640, seed=5, dtype=dtype, spread=4)
    return lambda: K.linear(x, w)


def _partials_combined():
    x, w, b = wide(64, 2048, seed=6), wide(128, 2048, seed=7, spread=4), wide(128, seed=8)
    xs, ws = x.chunk(4, -1), w.chunk(4, -1)
    return lambda: K.combine_partials(
        [K.linear_partial(a, c) for a, c in zip(xs, ws, strict=True)], x.dtype, b
    )


def _row_parallel(tp):
    x = wide(64, 768, seed=9, dtype=torch.bfloat16)
    w = wide(256, 768, seed=10, dtype=torch.bfloat16, spread=4)
    return lambda: K.row_parallel_linear(x, w, tp, wide(256, seed=11, dtype=torch.bfloat16))


def _rms_norm(rows, h, residual, dtype=torch.float32):
    x, r = wide(rows, h, seed=12, dtype=dtype), wide(rows, h, seed=13, dtype=dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g(14))).to(dtype)
    return lambda: K.rms_norm(x, w, 1e-6, r if residual else None)


def _rope():
    x = wide(2048, 8, 128, seed=15, dtype=torch.bfloat16, spread=4)
    pos = torch.randint(0, 8192, (2048,), generator=g(16))
    table = K.rope_table(128, 1e6, 8192)
    return lambda: K.rope(x, pos, table)


def tail_sensitive_value() -> torch.Tensor:
    """A value whose F.silu differs between the vectorised loop and the scalar tail loop: F.silu
    of a contiguous run (vector) against F.silu of a strided view (the scalar loop)."""
    c = wide(4096, seed=17, spread=3)
    vec, scalar = F.silu(c), F.silu(torch.stack([c, c], 1)[:, 0])
    differ = torch.nonzero(as_bits(vec) != as_bits(scalar))[:, 0]
    assert differ.numel(), "no value where F.silu's vector and scalar formulas disagree"
    return c[differ[0]]


SILU_N = 3 * (1 << 16) + 5
"""Not a multiple of the SIMD width, nor are its 2- and 4-thread chunks: tails move."""


def _silu_mul_inputs():
    """One long row of the tail-sensitive value, times 1: wherever a tail falls, it shows."""
    return tail_sensitive_value().expand(1, SILU_N).contiguous(), torch.ones(1, SILU_N)


def _silu_mul():
    gate, up = _silu_mul_inputs()
    batch_g, batch_u = wide(512, 768, seed=20, spread=3), wide(512, 768, seed=21, spread=3)
    return lambda: (K.silu_mul(gate, up), K.silu_mul(batch_g, batch_u))


def _attention():
    # Three packed sequences, the longest 200 tokens: 4 key blocks of 64, GQA 4 -> 2 heads.
    q = wide(300, 4, 64, seed=22, dtype=torch.bfloat16, spread=3)
    k = wide(300, 2, 64, seed=23, dtype=torch.bfloat16, spread=3)
    v = wide(300, 2, 64, seed=24, dtype=torch.bfloat16, spread=3)
    return lambda: K.attention(q, k, v, [0, 200, 201, 300])


def _paged_attention():
    """A 37-token chunk at positions 500..536 and a decode token at 900, over shuffled pages."""
    page, n_pages = 16, 96
    k_pages = wide(n_pages, page, 2, 64, seed=25, dtype=torch.bfloat16, spread=3)
    v_pages = wide(n_pages, page, 2, 64, seed=26, dtype=torch.bfloat16, spread=3)
    perm = torch.randperm(n_pages, generator=g(27))
    tables = [perm[:34], perm[34:]]
    q = wide(38, 4, 64, seed=28, dtype=torch.bfloat16, spread=3)
    return lambda: K.paged_attention(
        q, k_pages, v_pages, K.PagedBatch([0, 37, 38], tables, [537, 901])
    )


VOCAB = 151936
"""Qwen3's vocab: 8 segments of 18992."""


def _log_softmax():
    one, batch = wide(1, VOCAB, seed=29, spread=4), wide(16, VOCAB, seed=30, spread=4)
    return lambda: (K.log_softmax(one), K.log_softmax(batch))


def _token_logprobs():
    logits = wide(16, VOCAB, seed=31, dtype=torch.bfloat16, spread=4)
    tokens = torch.randint(0, VOCAB, (16,), generator=g(32))
    return lambda: (K.token_logprobs(logits, tokens), K.token_logprobs(logits, tokens, 0.7),
                    K.vocab_parallel_token_logprobs(logits.chunk(4, -1), tokens, 0.7))  # fmt: skip


# MoE over several K-blocks: H = 384 (3 blocks), expert width 256 (2 blocks).
E, H, INTER, TOP, T = 8, 384, 256, 4, 64


def _moe_weights(dtype=torch.bfloat16):
    return (wide(E, H, seed=33, dtype=dtype, spread=2),
            (wide(E, INTER, H, seed=34, spread=1) * 0.05).to(dtype),
            (wide(E, INTER, H, seed=35, spread=1) * 0.05).to(dtype),
            (wide(E, H, INTER, seed=36, spread=1) * 0.05).to(dtype))  # fmt: skip


def _moe_x(dtype=torch.bfloat16):
    return wide(T, H, seed=37, dtype=dtype, spread=3)


def _moe_route():
    x, router = _moe_x(), wide(128, H, seed=38, dtype=torch.bfloat16, spread=2)
    return lambda: K.moe_route(x, router, 8)


def _moe_expert_outputs():
    x, (gate, wg, wu, wd) = _moe_x(), _moe_weights()
    ids, _ = K.moe_route(x, gate, TOP)
    return lambda: (K.moe_expert_outputs(x, ids, wg, wu, wd),
                    K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=[1, 2, 5]))  # fmt: skip


def _moe_combine():
    outs = wide(4096, TOP, H, seed=39, dtype=torch.bfloat16, spread=4)
    scores = torch.rand(4096, E, generator=g(40))
    ids = torch.argsort(scores, dim=-1)[:, :TOP]
    weights = torch.rand(4096, TOP, generator=g(41))
    return lambda: K.moe_combine(outs, ids, weights)


def _moe():
    x, w = _moe_x(), _moe_weights()
    return lambda: K.moe(x, *w, TOP)


CASES: dict[str, Callable[[], Callable[[], object]]] = {
    "linear_long_row": _linear_long_row,
    "linear_batch_fp32": lambda: _linear_batch(torch.float32),
    "linear_batch_bf16": lambda: _linear_batch(torch.bfloat16),
    "linear_partial_combine_partials": _partials_combined,
    "row_parallel_linear_tp2": lambda: _row_parallel(2),
    "row_parallel_linear_tp4": lambda: _row_parallel(4),
    "rms_norm_long_row": lambda: _rms_norm(1, 1 << 18, residual=False),
    "rms_norm_long_row_residual": lambda: _rms_norm(1, 1 << 18, residual=True),
    "rms_norm_batch_bf16": lambda: _rms_norm(256, 2048, False, torch.bfloat16),
    "rms_norm_batch_bf16_residual": lambda: _rms_norm(256, 2048, True, torch.bfloat16),
    "rope": _rope,
    "silu_mul": _silu_mul,
    "attention": _attention,
    "paged_attention": _paged_attention,
    "log_softmax": _log_softmax,
    "token_logprobs": _token_logprobs,
    "moe_route": _moe_route,
    "moe_expert_outputs": _moe_expert_outputs,
    "moe_combine": _moe_combine,
    "moe": _moe,
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_exact_op_bits_do_not_depend_on_the_thread_count(name):
    reports = thread_reports(CASES[name]())
    assert not reports, "\n".join(reports)


def test_reference_model_logprobs_do_not_depend_on_the_thread_count(tiny_checkpoint):
    from onpolicy.models.reference import Qwen3MoeReference

    model = Qwen3MoeReference.from_pretrained(tiny_checkpoint)
    seqs = [torch.randint(0, 990, (n,), generator=g(42 + n)).tolist() for n in (90, 3, 41)]

    def run():
        scored = model.score(seqs, temperature=0.8)
        reqs = model.generate([s[:20] for s in seqs], max_new_tokens=8, temperature=1.0,
                              seed=3, chunk_size=7)  # fmt: skip
        outs = torch.tensor([t for r in reqs for t in r.output])
        return scored, [torch.tensor(r.logprobs) for r in reqs], outs

    reports = thread_reports(run)
    assert not reports, "\n".join(reports)


# --- negative controls --------------------------------------------------------------------------
SEEDS = range(16)


def test_negative_control_a_long_row_sum_is_split_across_threads():
    """torch reduces a single output over > GRAIN elements in per-thread chunks and adds the
    chunk results: another summation order, so most seeds' sums change bits at 2 or 4 threads.
    Below the grain the sum runs on one thread and no seed changes."""
    long_rows = [wide(1 << 20, seed=s) for s in SEEDS]
    changed = sum(bool(thread_reports(lambda x=x: x.sum())) for x in long_rows)
    assert changed >= len(SEEDS) // 2, f"only {changed} of {len(SEEDS)} long-row sums changed"
    short_rows = [wide(GRAIN // 2, seed=s) for s in SEEDS]
    assert not any(thread_reports(lambda x=x: x.sum()) for x in short_rows)
    exact = [thread_reports(lambda x=x: K.tree_sum(x, block=K.K_BLOCK)) for x in long_rows]
    assert not any(exact)


def test_negative_control_native_rms_norm_of_a_long_row_depends_on_the_thread_count():
    """The harness of the exact rms_norm case: HF's pow(2).mean(-1) over one row of 2^18 is a
    split reduction. Where the mean square's last bit moves, the scale moves, and with it almost
    every output; the exact norm keeps its bits on those rows."""
    w, seeds, changed = torch.ones(1 << 18), range(32), []
    for s in seeds:
        x = wide(1, 1 << 18, seed=s)
        with K.native_ops():
            if thread_reports(lambda x=x: K.rms_norm(x, w, 1e-6)):
                changed.append(x)
    assert len(changed) >= len(seeds) // 8, f"{len(changed)} of {len(seeds)} native norms changed"
    assert not any(thread_reports(lambda x=x: K.rms_norm(x, w, 1e-6)) for x in changed)


def test_negative_control_native_silu_mul_depends_on_the_thread_count():
    """F.silu's scalar tail loop runs wherever a thread chunk ends; on a value whose scalar and
    vector results differ, moving the chunk boundaries (1, 2, 4 threads) changes bits there."""
    gate, up = _silu_mul_inputs()
    with K.native_ops():
        assert len(thread_reports(lambda: K.silu_mul(gate, up))) == len(THREADS) - 1
    assert not thread_reports(lambda: K.silu_mul(gate, up))
