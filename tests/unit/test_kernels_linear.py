"""Exact linear: row (batch) invariance across K-blocks and row chunks, the block tree itself, TP
row-parallel exactness, the exactness rule, backward.

Inputs have wide exponents (2^-12 .. 2^12 per element), so any change of summation order shows
in the fp32 result. Each property is a harness returning mismatch reports; the property test
asserts there are none, and its negative control runs the same harness on the plain op (inside
`K.native_ops()`, one thread) or on another summation order, and asserts that it breaks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from adversarial import (
    CUDA,
    DEVICES,
    DTYPES,
    PROPERTY,
    assert_bitwise,
    bitwise_equal,
    mismatch_report,
    n_differ,
    one_thread,
    wide,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K
from onpolicy.kernels.cpu.linear import _CHUNK_ELEMS

BLOCKS_K = [3 * K.K_BLOCK, 5 * K.K_BLOCK, 6 * K.K_BLOCK, 7 * K.K_BLOCK]
"""K of 3, 5, 6 and 7 blocks: block trees with an odd carry (3, 5, 7) and an unbalanced one (6)."""


# --- batch invariance ---------------------------------------------------------------------------
def row_reports(x: torch.Tensor, w: torch.Tensor, row: int, b: torch.Tensor | None = None):
    """Row `row` of linear(x, w, b) alone against the same row inside three batches: x itself, x
    reversed with x after it, and x from `row` on. One report per batch whose row differs."""
    m = x.shape[0]
    alone = K.linear(x[row : row + 1], w, b)[0]
    batches = {"x": (x, row), "flip(x) + x": (torch.cat([x.flip(0), x]), m + row),
               "x[row:]": (x[row:], 0)}  # fmt: skip
    reports = []
    for what, (batch, at) in batches.items():
        got = K.linear(batch, w, b)[at]
        if not bitwise_equal(got, alone):
            where = f"row {row} in {what} (M={batch.shape[0]})"
            reports.append(f"{where}: {mismatch_report(got, alone)}")
    return reports


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=200)
@given(
    m=st.integers(1, 40),
    row=st.integers(0, 39),
    k=st.sampled_from([16, 64, 128, 200, *BLOCKS_K, 700]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_row_is_independent_of_batch_size_and_position(device, m, row, k, dtype, bias, seed):
    x = wide(m, k, seed=seed, dtype=dtype, device=device)
    w = wide(24, k, seed=seed + 1, dtype=dtype, spread=4, device=device)
    b = wide(24, seed=seed + 2, dtype=dtype, device=device) if bias else None
    reports = row_reports(x, w, row % m, b)
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("k", [64, 200, *BLOCKS_K])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_negative_control_torch_linear_breaks_row_independence(k, seed):
    """The same harness on fp32 F.linear (MKL): a lone row (M = 1) runs another kernel than a
    batch, with another order over K, so the row's bits change in every batch. (bf16 F.linear
    goes through oneDNN, which rounds to bf16 at the end: it hides the order, so fp32 it is.)"""
    x, w = wide(17, k, seed=seed), wide(24, k, seed=seed + 1, spread=4)
    with one_thread(), K.native_ops():
        reports = row_reports(x, w, 5)
    assert len(reports) == 3, reports
    assert not row_reports(x, w, 5)


def chunk_rows(k: int, n: int) -> int:
    """Rows per chunk of the CPU linear (at least one)."""
    return max(1, _CHUNK_ELEMS // (k * n))


CHUNKED = [(384, 1024, 13), (896, 1536, 11), (768, 6144, 3)]
"""(K, N, M): 10 rows a chunk, M crossing one boundary; 3 rows a chunk, M crossing three; K * N
above the chunk size, one row a chunk, every row its own chunk."""


def chunk_boundary_reports(k: int, n: int, m: int) -> list[str]:
    """Every row next to a chunk boundary of an M-row batch, alone vs in the batch."""
    rows = chunk_rows(k, n)
    assert rows < m, f"M = {m} does not cross a chunk of {rows} rows"
    x, w = wide(m, k, seed=k + n), wide(n, k, seed=m, spread=4)
    full = K.linear(x, w)
    near = sorted({r for b in range(rows, m, rows) for r in (b - 1, b)})
    reports = []
    for r in near:
        alone = K.linear(x[r : r + 1], w)[0]
        if not bitwise_equal(full[r], alone):
            reports.append(f"row {r} ({rows} rows a chunk): {mismatch_report(full[r], alone)}")
    shifted = K.linear(x[1:], w)  # every boundary now falls one row later
    if not bitwise_equal(shifted, full[1:]):
        reports.append(f"x[1:] vs rows 1.. of x: {mismatch_report(shifted, full[1:])}")
    return reports


@pytest.mark.parametrize(("k", "n", "m"), CHUNKED)
def test_rows_on_either_side_of_a_chunk_boundary_keep_their_bits(k, n, m):
    reports = chunk_boundary_reports(k, n, m)
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize(("k", "n", "m"), CHUNKED[:2])
def test_negative_control_torch_linear_breaks_at_chunk_boundaries(k, n, m):
    """The same harness on fp32 F.linear: every boundary row alone differs from the batch."""
    with one_thread(), K.native_ops():
        reports = chunk_boundary_reports(k, n, m)
    boundaries = len(range(chunk_rows(k, n), m, chunk_rows(k, n)))
    assert len([r for r in reports if r.startswith("row")]) == 2 * boundaries, reports


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_cublas_linear_depends_on_batch_size(device, dtype):
    """cuBLAS picks its kernel (tiles, split-K) from the whole shape: a row's bits differ between
    a batch of 2048 and the row alone, in fp32 and bf16."""
    x = wide(2048, 4096, seed=1, dtype=dtype, device=device)
    w = wide(4096, 4096, seed=2, dtype=dtype, spread=4, device=device)
    rows = range(0, 2048, 128)
    full = F.linear(x, w)[rows]
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in rows])
    assert not bitwise_equal(full, alone), mismatch_report(full, alone)
    exact = K.linear(x, w)[rows]
    assert_bitwise(exact, torch.cat([K.linear(x[i : i + 1], w) for i in rows]), "exact rows")


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_bias(device):
    x, w = wide(3, 5, 96, seed=3, device=device), wide(40, 96, seed=4, device=device)
    b = wide(40, seed=5, device=device)
    out = K.linear(x, w, b)
    assert out.shape == (3, 5, 40)
    assert_bitwise(out, K.linear(x.reshape(15, 96), w, b).view(3, 5, 40), "leading dims")
    assert_bitwise(out, K.combine_partials([K.linear_partial(x, w)], x.dtype, b), "partial path")
    scale = (x.abs() @ w.abs().T).max()
    torch.testing.assert_close(out, x @ w.T + b, rtol=0, atol=1e-6 * float(scale))


# --- the block tree -----------------------------------------------------------------------------
def np_tree(values: list[np.float32]) -> np.float32:
    """The pairwise tree spelled out on numpy fp32 scalars: (0+1), (2+3), ..., odd last carried."""
    while len(values) > 1:
        paired = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = paired + values[-1:] if len(values) % 2 else paired
    return values[0]


def np_block_sum(products: np.ndarray, order: str) -> np.float32:
    """The sum of one output's K products: the tree inside each 128-wide block, then the block
    sums by the tree ("tree"), left to right ("sequential") or right to left ("reversed")."""
    step = K.K_BLOCK
    blocks = [np_tree(list(products[i : i + step])) for i in range(0, len(products), step)]
    if order == "tree":
        return np_tree(blocks)
    if order == "reversed":
        blocks = blocks[::-1]
    total = blocks[0]
    for s in blocks[1:]:
        total = total + s
    return total


def block_order_reports(x: torch.Tensor, w: torch.Tensor, order: str) -> list[str]:
    """linear_partial(x, w) against `np_block_sum` of each output in `order`."""
    got = K.linear_partial(x, w)
    xs, ws = x.float().numpy(), w.float().numpy()
    want = torch.tensor([[np_block_sum(xs[m] * ws[n], order) for n in range(w.shape[0])]
                         for m in range(x.shape[0])], dtype=torch.float32)  # fmt: skip
    return [] if bitwise_equal(got, want) else [f"{order}: {mismatch_report(got, want)}"]


@pytest.mark.parametrize("k", [100, 128, 256, *BLOCKS_K, 700, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_sums_k_by_the_block_tree(k, dtype):
    """The CPU kernel is the documented order bit for bit: 3, 5, 7 blocks carry an odd block up,
    700 ends in a short block. (The CUDA leaf is the tensor core's chain: checked elsewhere.)"""
    x, w = wide(4, k, seed=k, dtype=dtype), wide(8, k, seed=k + 1, dtype=dtype)
    reports = block_order_reports(x, w, "tree")
    assert not reports, reports


@pytest.mark.parametrize(
    ("k", "order"),
    [(k, "reversed") for k in [*BLOCKS_K, 700]] + [(k, "sequential") for k in [*BLOCKS_K[1:], 700]],
)
def test_negative_control_other_block_orders_are_another_sum(k, order):
    """The same harness with the block sums added in another order: another association, which
    shows on wide inputs. So does fp32 F.linear (MKL's order)."""
    x, w = wide(4, k, seed=k), wide(8, k, seed=k + 1)
    assert block_order_reports(x, w, order)
    with one_thread(), K.native_ops():
        assert block_order_reports(x, w, "tree")


def test_three_blocks_left_to_right_is_the_tree():
    """Why 3 blocks has no left-to-right control: the tree over 3 is (b0 + b1) + b2, which is
    the left-to-right sum; right to left, b0 + (b1 + b2) with b0 last, is another sum."""
    x, w = wide(4, 384, seed=384), wide(8, 384, seed=385)
    assert not block_order_reports(x, w, "sequential")


# --- tensor parallel (row-parallel) -------------------------------------------------------------
def shards(x: torch.Tensor, w: torch.Tensor, tp: int, segments: int) -> list[torch.Tensor]:
    """Each simulated rank's fp32 partial over its contiguous K-slice: its segments / tp of the
    K's `segments` segments."""
    xs, ws = x.chunk(tp, dim=-1), w.chunk(tp, dim=-1)
    return [K.linear_partial(a, b, segments=segments // tp) for a, b in zip(xs, ws, strict=True)]


def row_parallel_reports(x, w, tp: int, segments: int, b=None) -> list[str]:
    """The sharded results against the unsharded ones, K in `segments` segments on both: the
    combined partials and `row_parallel_linear` against `linear`, and the fp32 tree of the
    partials against the unsharded fp32 partial (before any rounding)."""
    full, parts = K.linear(x, w, b, segments=segments), shards(x, w, tp, segments)
    checks = {
        "combine_partials": (K.combine_partials(parts, x.dtype, b), full),
        "row_parallel_linear": (K.row_parallel_linear(x, w, tp, b, segments=segments), full),
        "fp32 partials": (K.pairwise_tree_sum(parts), K.linear_partial(x, w, segments=segments)),
    }
    return [f"{what} at tp {tp}, S {segments}: {mismatch_report(got, want)}"
            for what, (got, want) in checks.items() if not bitwise_equal(got, want)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=150)
@given(
    k=st.sampled_from([64, 96, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]),
    tp=st.sampled_from([1, 2, 4, 8]),
    per_shard=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_row_parallel_partials_combine_to_the_unsharded_bits(device, k, tp, per_shard, dtype,
                                                             seed):  # fmt: skip
    """Any K, power-of-2 or not: S = tp x a power of 2 segments, each shard holding S / tp."""
    segments = tp * per_shard
    assume(k % segments == 0)
    assert K.row_parallel_exact(k, tp, segments)
    x = wide(6, k, seed=seed, dtype=dtype, device=device)
    w, b = wide(10, k, seed=seed + 1, dtype=dtype, device=device), None
    if seed % 2:
        b = wide(10, seed=seed + 2, dtype=dtype, device=device)
    reports = row_parallel_reports(x, w, tp, segments, b)
    assert not reports, "\n".join(reports)


OLD_INEXACT = [(768, 2, 2), (768, 4, 4), (768, 2, 4), (1536, 2, 2), (96, 2, 2),
               *((k, 2, 2) for k in BLOCKS_K)]  # fmt: skip
"""(K, tp, S) whose shards are not aligned subtrees of one block tree over K (S = 1): 768 at
tp 2 is 3 blocks a shard. Cut into S segments, each shard holds whole segments."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "tp", "segments"), OLD_INEXACT)
def test_segments_make_non_power_of_2_shards_exact(device, dtype, k, tp, segments):
    """`row_parallel_linear(x, w, tp, segments=S)` is `linear(x, w, segments=S)` bit for bit.
    Negative control in the same shapes: the unsplit K (S = 1) is another sum."""
    x = wide(16, k, seed=k + tp, dtype=dtype, device=device)
    w = wide(32, k, seed=k, dtype=dtype, device=device)
    full = K.linear(x, w, segments=segments)
    assert_bitwise(K.row_parallel_linear(x, w, tp, segments=segments), full, f"k {k} tp {tp}")
    reports = row_parallel_reports(x, w, tp, segments)
    assert not reports, "\n".join(reports)
    # The fp32 partial shows it in any dtype (bf16's last rounding could hide a few).
    unsplit = K.linear_partial(x, w)
    assert n_differ(K.linear_partial(x, w, segments=segments), unsplit) > 0, "S changed nothing"


@pytest.mark.parametrize("k", [64, 128, 256, 1024, 4096])
@pytest.mark.parametrize("segments", [2, 4, 8])
def test_power_of_2_segments_are_the_block_tree_on_cpu(k, segments):
    """CPU: with K and S powers of 2 the segment tree is the block tree itself, so S changes no
    bits. (Not a CUDA claim: there a segment is one chained accumulation.)"""
    x, w = wide(6, k, seed=k), wide(10, k, seed=k + 1)
    assert_bitwise(K.linear_partial(x, w, segments=segments), K.linear_partial(x, w), f"k {k}")


@pytest.mark.parametrize(("k", "tp"), [(64, 8), (256, 2), (1024, 4), (4096, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_torch_linear_shards_are_not_the_unsharded_sum(k, tp, dtype):
    """The same harness on the plain ops: each shard's F.linear sums its K in MKL's order, and
    neither the tree nor the plain sum of those partials is the unsharded F.linear. In bf16 the
    final rounding can hide it after the combine, never in the fp32 partials."""
    x, w = wide(6, k, seed=k, dtype=dtype), wide(10, k, seed=k + 1, dtype=dtype)
    with one_thread(), K.native_ops():
        reports = row_parallel_reports(x, w, tp, tp, wide(10, seed=tp, dtype=dtype))
    assert any(r.startswith("fp32 partials") for r in reports), reports
    assert any(r.startswith("row_parallel_linear") for r in reports), reports


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_naive_shard_sum_differs(device):
    """Summing the shards' partials left to right (or the BLAS partials) is not the tree."""
    x, w = wide(8, 4096, seed=7, device=device), wide(16, 4096, seed=8, device=device)
    full = K.linear(x, w, segments=4)
    parts = shards(x, w, 4, 4)
    left_to_right = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not bitwise_equal(left_to_right, full), "left-to-right shard sum"
    blas = sum(a @ b.T for a, b in zip(x.chunk(4, -1), w.chunk(4, -1), strict=True))
    assert not bitwise_equal(blas, full), "BLAS shard partials"
    assert_bitwise(K.row_parallel_linear(x, w, 4, segments=4), full, "exact row-parallel")


@pytest.mark.parametrize(
    ("k", "tp", "segments", "exact"),
    [
        (768, 1, 1, True),  # Qwen3-30B-A3B expert K, unsharded
        (768, 2, 1, False),  # one segment cannot be split over 2 shards
        (768, 2, 2, True),  # two 384-wide segments (3 blocks each), one a shard
        (768, 4, 4, True),
        (768, 2, 4, True),  # two 192-wide segments a shard: an aligned subtree of the 4
        (768, 2, 6, False),  # three a shard: not a subtree of the tree over 6
        (768, 4, 2, False),  # tp does not divide S
        (768, 3, 3, True),  # one segment a shard; the contract still asks for powers of 2
        (4096, 8, 8, True),  # attention K = 32 heads x 128 at TP 8
        (4096, 2, 8, True),  # TP 2 against the other side's TP 8: 4 segments a shard
        (64, 8, 8, True),
        (100, 8, 8, False),  # S does not divide K
        (1024, 2, 0, False),
    ],
)
def test_row_parallel_exact_rule(k, tp, segments, exact):
    assert K.row_parallel_exact(k, tp, segments) is exact


def test_a_cut_that_splits_a_segment_is_refused():
    x, w = wide(2, 768, seed=1), wide(3, 768, seed=2)
    with pytest.raises(ValueError, match="tp must divide the segment count"):
        K.row_parallel_linear(x, w, 4, segments=2)
    with pytest.raises(ValueError, match="segments = 5 must be >= 1 and divide K = 768"):
        K.linear(x, w, segments=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("k", "tp"), [(768, 4), (1536, 2), (96, 2), *((k, 2) for k in BLOCKS_K)])
def test_inexact_shapes_really_differ_and_stay_row_invariant(device, k, tp):
    """The rule's no (`row_parallel_exact(k, tp, 1)`): shards at their own TP (S = tp, one
    segment each) against the unsplit K (S = 1) are another sum, and it shows on wide inputs.
    A process alone, at its own TP, is still the same bits for every engine cut at that tp: a
    row's sharded result does not depend on the batch."""
    assert not K.row_parallel_exact(k, tp, 1)
    x, w = wide(16, k, seed=k + tp, device=device), wide(32, k, seed=k, device=device)
    full, sharded = K.linear(x, w), K.row_parallel_linear(x, w, tp)
    assert not bitwise_equal(sharded, full), "the rule says inexact, the bits agree"
    for r in (0, 7, 15):
        alone = K.row_parallel_linear(x[r : r + 1], w, tp)[0]
        assert_bitwise(alone, sharded[r], f"row {r} alone at tp {tp}")
        assert_bitwise(K.row_parallel_linear(x.flip(0), w, tp)[15 - r], sharded[r], "flipped")


def test_negative_control_torch_row_parallel_linear_depends_on_the_batch():
    """The same per-row check on the plain row-parallel op (each shard's F.linear, then a sum):
    MKL's lone-row kernel changes the shards' partials, so the row's bits change."""
    x, w = wide(16, 768, seed=770), wide(32, 768, seed=768)
    with one_thread(), K.native_ops():
        sharded = K.row_parallel_linear(x, w, 2)
        alone = {r: K.row_parallel_linear(x[r : r + 1], w, 2)[0] for r in (0, 7, 15)}
    assert all(not bitwise_equal(a, sharded[r]) for r, a in alone.items())


@pytest.mark.parametrize("device", DEVICES)
def test_rule_agrees_with_the_kernel_for_every_small_shape(device):
    """Exact where the rule says so, and different bits wherever it says no: every K up to 1024
    that S divides, every tp that divides S; the no's are S / tp = 3, 5, 6, 7 segments a shard
    (on CPU a power-of-2 S / tp over a power-of-2 K is the block tree whatever the cut, so the
    no's are the counts that are not powers of 2)."""
    x = wide(4, 1024, seed=11, device=device)
    w = wide(8, 1024, seed=12, device=device)
    yes = no = 0
    for k in (96, 192, 256, 384, 512, 640, 768, 896, 1024):
        for segments in range(1, 17):
            for tp in (2, 4, 8):
                if k % segments or segments % tp:
                    continue
                args = (x[:, :k], w[:, :k])
                sharded = K.row_parallel_linear(*args, tp, segments=segments)
                full = K.linear(*args, segments=segments)
                if K.row_parallel_exact(k, tp, segments):
                    assert_bitwise(sharded, full, f"k {k} tp {tp} S {segments}")
                    yes += 1
                else:
                    assert n_differ(sharded, full) > 0, f"k {k} tp {tp} S {segments}: inexact"
                    no += 1
    print(f"{yes} exact cuts, {no} inexact ones, all as the rule says")
    assert yes > 20 and no > 10, (yes, no)


# --- backward and dispatch ----------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_autograd(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 7, 192).to(dtype).to(device).requires_grad_()
    w = torch.randn(33, 192).to(dtype).to(device).requires_grad_()
    b = torch.randn(33).to(dtype).to(device).requires_grad_()
    g = torch.randn(5, 7, 33).to(device)
    (K.linear(x, w, b).float() * g).sum().backward()
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    ((xr @ wr.T + br) * g).sum().backward()
    tol = {"rtol": 2e-2, "atol": 2e-1} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    for ours, ref in ((x, xr), (w, wr), (b, br)):
        torch.testing.assert_close(ours.grad.float(), ref.grad, **tol)


def test_other_devices_are_refused_by_name():
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(NotImplementedError, match=r"onpolicy\.kernels\.linear: .*'meta'"):
        K.linear(x, torch.empty(3, 8, device="meta"))
    with pytest.raises(NotImplementedError, match="rms_norm"):
        K.rms_norm(x, torch.empty(8, device="meta"), 1e-6)
