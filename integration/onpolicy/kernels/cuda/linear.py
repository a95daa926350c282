"""Exact linear (CUDA): K in S equal segments (`rules.k_segments`), each one chained
tensor-core accumulation, the segment partials summed by the pairwise tree.

For an output tile the kernel walks each segment of K in chunks of BLOCK_K, chaining the
chunks' products into one fp32 accumulator that starts at zero (`tl.dot(a, w, acc)`): the
tensor core's own order, one k16 instruction after another, so an element's bits depend only
on its row of x, its column of w and the segment, never on the tile, the chunk width or the
pipelining. The segment partials are combined by the pairwise tree of `kernels.tree` with a
binary-counter stack unrolled at compile time: after segment j, partial sums of 2^i segments
sit in level i for every set bit i of j + 1. S = 1 (an unsplit K, or a TP that cuts it on no
side of the run) is a plain GEMM with one accumulator; a row-parallel rank holding S / tp
whole segments computes an aligned subtree (`rules.row_parallel_exact`).

The tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) may change with M and S: it decides only
which outputs a program computes and how wide a chunk is, never the order of an output's sum
(`tests/gpu/test_cuda_kernels.py` runs every tile on the same rows). There is no split-K over
programs: the only cut of K is the segments, fixed for the run. An fp32 dot (IEEE, no tensor
cores) is one fused multiply-add per k, in k order, into the accumulator (Triton's FMA
lowering), so its bits do not depend on the tile either; its code is those FMAs unrolled over
the tile, so fp32 launches take narrower, shallower tiles (`launch_tile`), which compile
several times faster (docs/benchmarks.md, "Triton compile time of the kernels' variants").

M is not specialized (`do_not_specialize`): Triton would compile a variant for M = 1, for M a
multiple of 16 and for the rest, so the variants a run compiles would follow its batch sizes.
Unspecialized, a variant is fixed by the tile and the flags alone, which `warmup` can cover. M
only bounds rows, so the bits do not change.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from onpolicy.kernels import autograd as _shared
from onpolicy.kernels.cuda.elementwise import _swiglu
from onpolicy.kernels.rules import cdiv, check_segments
from onpolicy.kernels.tree import combine_partials

Tile = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, pipeline stages) of one launch."""

TINY_M: Tile = (16, 32, 256, 4, 3)
"""Decode at a few requests (a GEMV): 16 rows, as few as the tensor core takes (`mma.sync`),
so a program streams its 32 columns of w in 256-wide chunks with little wasted MMA work. At
M <= 8 on an H100 it runs the decode GEMMs at 0.89-1.05 of cuBLAS where SMALL_M ran at
0.58-0.86 (docs/benchmarks.md, "Decode GEMMs as CUDA-graph replays")."""
SMALL_M: Tile = (64, 32, 128, 4, 4)
"""Decode-sized batches: narrow N tiles so a GEMV still spreads over every SM."""
MID_M: Tile = (64, 64, 128, 4, 4)
LARGE_M: Tile = (128, 256, 64, 8, 4)
"""One accumulator (S = 1) over at least FULL_WAVES waves of tiles, loaded by TMA."""
LARGE_M_SEGMENTED: Tile = (128, 128, 64, 8, 5)
"""S > 1 keeps a stack of partials live (half the tile's registers each), and fewer tiles
than FULL_WAVES waves of 128 x 256 leave SMs idle in the last wave: the smaller tile."""
LARGE_M_INDEXED: Tile = (128, 256, 64, 8, 3)
LARGE_M_SEGMENTED_INDEXED: Tile = (128, 128, 64, 8, 4)
"""Rows read by index (the MoE's grouped GEMM), loaded by pointers."""
SMS, FULL_WAVES = 132, 4
"""The H200's SMs, and the waves of 128 x 256 tiles above which their tail costs little."""
FORCE: Tile | None = None
"""Tests set this to run every launch at one tile (the bits must not change)."""
ROW_BOUNDS = (16, 64, 512)
"""The largest M of TINY_M, SMALL_M and MID_M launches."""
FP32_MAX_N, FP32_MAX_K = 64, 16
"""BLOCK_N and BLOCK_K of fp32 launches at most: a thread unrolls BLOCK_M x BLOCK_N x BLOCK_K /
(32 x warps) FMAs per chunk and segment, and the compile time grows with it."""


def tile_for(m: int, n: int, segments: int = 1, tma: bool = True) -> Tile:
    """The launch's tile, chosen from the problem's size and whether its tiles load by TMA.
    Any tile gives the same bits."""
    if FORCE is not None:
        return FORCE
    if m <= ROW_BOUNDS[0]:
        return TINY_M
    if m <= ROW_BOUNDS[1]:
        return SMALL_M
    if m <= ROW_BOUNDS[2]:
        return MID_M
    if not tma:
        return LARGE_M_INDEXED if segments == 1 else LARGE_M_SEGMENTED_INDEXED
    if segments == 1 and cdiv(m, 128) * cdiv(n, 256) >= FULL_WAVES * SMS:
        return LARGE_M
    return LARGE_M_SEGMENTED


def launch_tile(tile: Tile, dtype: torch.dtype) -> Tile:
    """The tile a launch of `dtype` inputs runs: `tile` itself for half precision; for fp32, its
    BLOCK_M and warps (a grouped launch's table is cut by BLOCK_M) with BLOCK_N and BLOCK_K
    capped and one pipeline stage (the FMA dot gains nothing from deeper prefetch)."""
    if dtype != torch.float32:
        return tile
    bm, bn, bk, warps, _ = tile
    return bm, min(bn, FP32_MAX_N), min(bk, FP32_MAX_K), warps, 1


MAX_SEGMENTS = 64
"""Segments the kernel unrolls at most (S is a TP: 8 in practice)."""


@triton.jit
def _push(c, s0, s1, s2, s3, s4, s5, j: tl.constexpr):
    """Segment j's partial c enters the stack: merged with every full level (the trailing one
    bits of j), then parked at the first free level. j is a compile-time constant, so only
    the levels in use exist."""
    if j & 1:
        c = s0 + c
        if j & 2:
            c = s1 + c
            if j & 4:
                c = s2 + c
                if j & 8:
                    c = s3 + c
                    if j & 16:
                        c = s4 + c
                        s5 = c
                    else:
                        s4 = c
                else:
                    s3 = c
            else:
                s2 = c
        else:
            s1 = c
    else:
        s0 = c
    return s0, s1, s2, s3, s4, s5


@triton.jit
def _root(c, s0, s1, s2, s3, s4, s5, n: tl.constexpr):
    """The tree's root once the last segment c joins a stack that holds n segments: c is
    added onto every occupied level (the set bits of n), lowest first: the odd-carry tree."""
    acc = c
    if n & 1:
        acc = s0 + acc
    if n & 2:
        acc = s1 + acc
    if n & 4:
        acc = s2 + acc
    if n & 8:
        acc = s3 + acc
    if n & 16:
        acc = s4 + acc
    if n & 32:
        acc = s5 + acc
    return acc


@triton.jit
def _sealed(c, SEAL: tl.constexpr):
    """c through an identity the compiler cannot see into. Triton rewrites `s + dot(a, b, 0)`
    as `dot(a, b, s)` (its dot-add combine), which chains s into the tensor-core accumulation:
    a segment of one chunk (seg_k <= BLOCK_K, whose loop folds away) would then start from the
    partial below it in the tree instead of from zero, and the bits would depend on the tile.
    The interpreter does no such rewrite (and has no inline asm): SEAL is off there."""
    if SEAL:
        c = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [c], dtype=tl.float32,
                                      is_pure=True, pack=1)  # fmt: skip
    return c


@triton.jit
def _segment(
    x_rows, u_rows, w_cols, m_ok, n_ok, k0, seg_k: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
    SEAL: tl.constexpr, SWIGLU: tl.constexpr,
):  # fmt: skip
    """One segment [k0, k0 + seg_k): its chunks' products chained from zero. SWIGLU: x is the
    gate, and a row's chunk is silu(gate) * up, rounded as `silu_mul` rounds it."""
    rk = tl.arange(0, BK)
    c = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, seg_k, BK):
        kk = k0 + j + rk
        if EVEN:
            a_ok = m_ok[:, None]
            b = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = j + rk < seg_k
            a_ok = m_ok[:, None] & k_ok[None, :]
            b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a = tl.load(x_rows + kk[None, :], mask=a_ok, other=0.0)
        if SWIGLU:
            a = _swiglu(a, tl.load(u_rows + kk[None, :], mask=a_ok, other=0.0))
        if IEEE:
            c = tl.dot(a, b, c, input_precision="ieee")
        else:
            c = tl.dot(a, b, c)
    return _sealed(c, SEAL)


@triton.jit
def _segment_tma(x_desc, w_desc, row0, col0, k0, seg_k: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, SEAL: tl.constexpr):  # fmt: skip
    """`_segment` through the tensor-memory accelerator: the same chunks, the same chain."""
    c = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, seg_k, BK):
        a = x_desc.load([row0, k0 + j])
        b = w_desc.load([col0, k0 + j])
        c = tl.dot(a, b.T, c)
    return _sealed(c, SEAL)


@triton.jit(do_not_specialize=["M"])
def _mm_tma_kernel(
    x_desc, w_desc, out_ptr, M, N, stride_om, OUT_FP32: tl.constexpr,
    SEGMENTS: tl.constexpr, SEG_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr, SEAL: tl.constexpr,
):  # fmt: skip
    """`_mm_kernel` for a plain [M, K] x with whole chunks in every segment, its tiles loaded
    by TMA (rows past M read as zero)."""
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    n_tiles_m = tl.cdiv(M, BM)
    group = pid // (GROUP_M * n_tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * n_tiles_n)) // size_m
    row0, col0 = pid_m * BM, pid_n * BN
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    s0, s1, s2, s3, s4, s5 = zero, zero, zero, zero, zero, zero
    for j in tl.static_range(SEGMENTS - 1):
        c = _segment_tma(x_desc, w_desc, row0, col0, j * SEG_K, SEG_K, BM, BN, BK, SEAL)
        s0, s1, s2, s3, s4, s5 = _push(c, s0, s1, s2, s3, s4, s5, j)
    c = _segment_tma(x_desc, w_desc, row0, col0, (SEGMENTS - 1) * SEG_K, SEG_K, BM, BN, BK, SEAL)
    acc = _root(c, s0, s1, s2, s3, s4, s5, SEGMENTS - 1)
    rm = row0 + tl.arange(0, BM)
    rn = col0 + tl.arange(0, BN)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    if OUT_FP32:
        tl.store(out, acc, mask=ok)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(
    x_ptr, u_ptr, w_ptr, w2_ptr, out_ptr, out2_ptr, rows_ptr, dst_ptr, tile_expert_ptr,
    tile_start_ptr, tile_end_ptr, M, N, stride_xm, stride_we, stride_wn, stride_om, n_experts,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, GROUPED: tl.constexpr, PAIRS: tl.constexpr,
    ROW_DIV: tl.constexpr, DUAL: tl.constexpr, OUT_FP32: tl.constexpr,
    SEGMENTS: tl.constexpr, SEG_K: tl.constexpr, EVEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, SEAL: tl.constexpr, SWIGLU: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    if DUAL:  # the second half of the grid multiplies by w2 into out2 (gate and up at once)
        half = tl.num_programs(0) // 2
        if pid >= half:
            pid -= half
            w_ptr = w2_ptr
            out_ptr = out2_ptr
    if GROUPED:  # one M-tile of one expert's rows, from the tile table
        pid_m, pid_n = pid // n_tiles_n, pid % n_tiles_n
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
        w_ptr += e.to(tl.int64) * stride_we
    elif PAIRS:  # one (token, slot) pair per M-tile, its expert read from the ids
        pid_m, pid_n = pid // n_tiles_n, pid % n_tiles_n
        e = tl.load(tile_expert_ptr + pid_m)
        if (e < 0) | (e >= n_experts):
            return
        row0 = pid_m
        row_end = pid_m + 1
        w_ptr += e.to(tl.int64) * stride_we
    else:  # GROUP_M M-tiles share their W columns in L2 (the launch order only)
        n_tiles_m = tl.cdiv(M, BM)
        group = pid // (GROUP_M * n_tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * n_tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * n_tiles_n)) // size_m
        row0 = pid_m * BM
        row_end = M
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < row_end, rn < N
    if GATHER:
        src = tl.load(rows_ptr + rm, mask=m_ok, other=0)
    else:
        src = rm // ROW_DIV
    x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
    u_rows = u_ptr + src.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    s0, s1, s2, s3, s4, s5 = zero, zero, zero, zero, zero, zero
    for j in tl.static_range(SEGMENTS - 1):
        c = _segment(x_rows, u_rows, w_cols, m_ok, n_ok, j * SEG_K, SEG_K, BM, BN, BK, EVEN,
                     IEEE, SEAL, SWIGLU)  # fmt: skip
        s0, s1, s2, s3, s4, s5 = _push(c, s0, s1, s2, s3, s4, s5, j)
    c = _segment(x_rows, u_rows, w_cols, m_ok, n_ok, (SEGMENTS - 1) * SEG_K, SEG_K, BM, BN, BK,
                 EVEN, IEEE, SEAL, SWIGLU)  # fmt: skip
    acc = _root(c, s0, s1, s2, s3, s4, s5, SEGMENTS - 1)
    dst = tl.load(dst_ptr + rm, mask=m_ok, other=0) if SCATTER else rm
    out = out_ptr + dst.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if OUT_FP32:
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tree_mm(
    x: torch.Tensor, weight: torch.Tensor, *, segments: int = 1,
    out_dtype: torch.dtype | None = None, rows: torch.Tensor | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out_rows: int | None = None, tile: Tile | None = None, dst: torch.Tensor | None = None,
    out: torch.Tensor | None = None, pair_experts: torch.Tensor | None = None, row_div: int = 1,
    weight2: torch.Tensor | None = None, out2: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight[N, K].T, K in `segments` chained segments added by the tree; fp32
    out unless `out_dtype`.

    Grouped (MoE): weight is [E, N, K], `tiles` = (expert, first row, end row) per M-tile of
    the output, `rows` [out_rows] the row of x each output row reads (None: the same row), and
    `tile` the tile the table was cut for (its BLOCK_M rows per M-tile); `dst` [out_rows] the
    row of `out` (given, or new) each computed row is stored to (None: the same row).
    Per pair (MoE, small batches): `pair_experts` [out_rows] the expert of each output row, one
    row per M-tile (rows of experts outside [0, E) are not computed), x's row = row // row_div.
    With `weight2` (same shape as weight) and `out2`, one launch also computes x @ weight2.T
    into out2. With `up` (x's shape): x is a SwiGLU's gate, and the rows multiplied are
    silu_mul(x, up)'s, computed as they are loaded (the bits of `silu_mul` then this GEMM).
    """
    k = x.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"linear: x has K={k}, weight [.., N, K] has K={weight.shape[-1]}")
    check_segments(max(k, 1), segments)
    if segments > MAX_SEGMENTS:
        raise ValueError(f"linear: segments = {segments}; the kernel unrolls at most "
                         f"{MAX_SEGMENTS}")  # fmt: skip
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"linear: up {tuple(up.shape)} {up.dtype} must match the gate "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    if x.stride(-1) != 1 or (up is not None and up.stride() != x.stride()):
        x = x.contiguous()
        up = None if up is None else up.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    n = weight.shape[-2]
    m = x.shape[0] if out_rows is None else out_rows
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype or torch.float32)
    grouped, pairs = tiles is not None, pair_experts is not None
    indexed = (grouped or pairs or rows is not None or dst is not None or weight2 is not None
               or up is not None)  # fmt: skip
    picked = tile or tile_for(m, n, segments, tma=not indexed)
    bm, bn, bk, warps, stages = launch_tile(picked, x.dtype)
    n_tiles = tiles[0].numel() if grouped else m if pairs else cdiv(m, bm)
    if m == 0 or n == 0 or n_tiles == 0 or k == 0:
        return out.zero_()
    dummy = out
    seg_k = k // segments
    if _tma_fits(x, weight, indexed, seg_k, bk):
        _mm_tma_kernel[(n_tiles * cdiv(n, bn),)](
            TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(weight, [bn, bk]), out, m, n, out.stride(0),
            OUT_FP32=out_dtype is None, SEGMENTS=segments, SEG_K=seg_k, BM=bm, BN=bn, BK=bk,
            GROUP_M=8, SEAL=SEAL and segments > 1, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    te, ts, tend = tiles if grouped else (pair_experts if pairs else dummy, dummy, dummy)
    dual = weight2 is not None
    if dual:
        if weight2.shape != weight.shape or weight2.stride() != weight.stride():
            raise ValueError("linear: weight2 must have weight's shape and strides")
        if out2 is None:
            out2 = torch.empty_like(out)
    _mm_kernel[((2 if dual else 1) * n_tiles * cdiv(n, bn),)](
        x, x if up is None else up, weight, weight2 if dual else weight, out,
        out2 if dual else out,
        rows if rows is not None else dummy, dst if dst is not None else dummy,
        te, ts, tend, m, n, x.stride(0), weight.stride(0) if grouped or pairs else 0,
        weight.stride(-2), out.stride(0), weight.shape[0] if grouped or pairs else 0,
        GATHER=rows is not None, SCATTER=dst is not None, GROUPED=grouped, PAIRS=pairs,
        ROW_DIV=row_div, DUAL=dual, OUT_FP32=out_dtype is None,
        SEGMENTS=segments, SEG_K=seg_k, EVEN=seg_k % bk == 0, BM=bm, BN=bn, BK=bk, GROUP_M=8,
        IEEE=x.dtype == torch.float32, SEAL=SEAL and segments > 1, SWIGLU=up is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


SEAL = os.environ.get("TRITON_INTERPRET") != "1"
"""Seal each segment's partial before the tree adds it (`_sealed`); tests turn it off to show
what the compiler's dot-add combine does without it."""

TMA = True
"""Load plain GEMM tiles by TMA where the shapes allow (the bits are the same either way)."""


def _tma_fits(x: torch.Tensor, w: torch.Tensor, indexed: bool, seg_k: int, bk: int) -> bool:
    """TMA needs 16-byte aligned rows and bases, whole chunks in every segment (a descriptor
    zero-fills only past the tensor's end, not past a segment's), and half-precision inputs."""
    if (
        not (TMA and x.is_cuda)
        or indexed
        or seg_k % bk
        or x.dtype not in (torch.bfloat16, torch.float16)
    ):
        return False
    return all(t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (x, w))  # fmt: skip


def _matmul(x: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    return tree_mm(x, weight, segments=segments)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """fp32 x @ weight.T over this weight's K in `segments` segments: no bias, not rounded."""
    return _shared.linear_partial(_matmul, x, weight, segments)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, segments: int = 1
) -> torch.Tensor:
    """x @ weight.T (+ bias): the cast is fused into the kernel when there is no bias. A bias
    is added to the fp32 partial outside it (`combine_partials`): fused, the compiler may
    contract it into the last fp32 product and change the bits."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if bias is not None or grad:
        return combine_partials([linear_partial(x, weight, segments)], x.dtype, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = tree_mm(flat, weight, segments=segments, out_dtype=x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])
