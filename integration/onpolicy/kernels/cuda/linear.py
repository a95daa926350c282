"""Exact linear (CUDA): fixed tiles, chained tensor-core products inside each MMA_LEAF-wide
leaf of K, the leaf partials summed by the pairwise tree.

For an output tile the kernel walks K in chunks of K_BLOCK. A leaf (MMA_LEAF / K_BLOCK chunks)
starts from a zero accumulator and chains its chunks' products into it (`tl.dot(a, w, acc)`),
so its bits depend only on that row of x and column of w inside the leaf: the tensor core's own
order, the same for every tile. The leaf partials are combined by the pairwise tree of
`kernels.tree` with a binary-counter stack: after leaf j, partial sums of 2^i leaves sit in
level i for every set bit i of j + 1, and a completed level is added to the one above. A
power-of-2 count of aligned leaves is therefore a subtree, which is what row-parallel
exactness needs (`rules.row_parallel_exact(k, tp, "cuda")`: a shard holds whole leaves).

The tile shape and warp count are fixed for all M (and for the grouped MoE variant), so a row
gets the same bits at any batch size and position. There is no split-K: splitting K over
programs would change the order with the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onpolicy.kernels import autograd as _shared
from onpolicy.kernels.rules import K_BLOCK, MMA_LEAF
from onpolicy.kernels.tree import combine_partials

Tile = tuple[int, int, int, int]
"""(BLOCK_M, BLOCK_N, warps, pipeline stages) of one launch."""

SMALL_M: Tile = (64, 32, 4, 4)
LARGE_M: Tile = (64, 64, 8, 3)
FORCE: Tile | None = None
"""Tests set this to run every launch at one tile (the bits must not change)."""


def tile_for(m: int, n: int) -> Tile:
    """The launch's tile, chosen from the problem's size. Any tile gives the same bits: a tile
    only decides which outputs one program computes, never the order of an output's sum
    (`tests/gpu/test_cuda_kernels.py` runs every tile on the same rows)."""
    if FORCE is not None:
        return FORCE
    return SMALL_M if m <= 256 else LARGE_M


MAX_LEVELS = 7
"""Stack levels the kernel can hold: fewer than 2^7 + 1 leaves."""

LEAF_CHUNKS = MMA_LEAF // K_BLOCK
"""K_BLOCK-wide chunks chained into one leaf."""


@triton.jit
def _push(c, s0, s1, s2, s3, s4, s5, s6, j, LEVELS: tl.constexpr):
    """Leaf j's partial c enters the stack: merge it with every full level (the trailing one
    bits of j), then park the sum at the first free level. Only LEVELS levels are compiled, so
    a short K keeps no dead accumulators in registers."""
    if LEVELS > 1 and j & 1:
        c = s0 + c
        if LEVELS > 2 and j & 2:
            c = s1 + c
            if LEVELS > 3 and j & 4:
                c = s2 + c
                if LEVELS > 4 and j & 8:
                    c = s3 + c
                    if LEVELS > 5 and j & 16:
                        c = s4 + c
                        if LEVELS > 6 and j & 32:
                            c = s5 + c
                            s6 = c
                        else:
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
    return s0, s1, s2, s3, s4, s5, s6


@triton.jit
def _root(c, s0, s1, s2, s3, s4, s5, s6, n: tl.constexpr):
    """The tree's root once the last leaf c joins a stack that holds n leaves: c is pushed
    onto every occupied level (the set bits of n), lowest first. That is `_push` of leaf n
    followed by the odd-carry fold of the levels, without parking c: one stack level fewer
    stays live through the loop."""
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
    if n & 64:
        acc = s6 + acc
    return acc


@triton.jit
def _tree_mm_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    M, N, K, stride_xm, stride_we, stride_wn, stride_om,
    GATHER: tl.constexpr, GROUPED: tl.constexpr, OUT_FP32: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, LEAF: tl.constexpr, NUM_LEAVES: tl.constexpr,
    LEVELS: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if GROUPED:  # one M-tile of one expert's rows, from the tile table
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        row0 = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
        w_ptr += e.to(tl.int64) * stride_we
    else:
        row0 = pid_m * BM
        row_end = M
    rm = row0 + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < row_end, rn < N
    src = tl.load(rows_ptr + rm, mask=m_ok, other=0) if GATHER else rm
    x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    s0, s1, s2, s3, s4, s5, s6 = zero, zero, zero, zero, zero, zero, zero
    c = zero
    # Every leaf but the last: chained into c, then pushed onto the stack.
    for j in range((NUM_LEAVES - 1) * LEAF):
        kk = j * BK + rk
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
        c = tl.where(j % LEAF == 0, 0.0, c)  # a leaf starts from a zero accumulator
        if IEEE:
            c = tl.dot(a, b, c, input_precision="ieee")
        else:
            c = tl.dot(a, b, c)
        if j % LEAF == LEAF - 1:
            s0, s1, s2, s3, s4, s5, s6 = _push(c, s0, s1, s2, s3, s4, s5, s6, j // LEAF, LEVELS)
    # The last leaf (the only one that may be short): its own loop, so the loop above has no
    # K mask (a mask the compiler cannot prove uniform stops pipelining).
    c = zero
    for j in range((NUM_LEAVES - 1) * LEAF, NUM_CHUNKS):
        kk = j * BK + rk
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = kk < K
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            c = tl.dot(a, b, c, input_precision="ieee")
        else:
            c = tl.dot(a, b, c)
    acc = _root(c, s0, s1, s2, s3, s4, s5, s6, NUM_LEAVES - 1)
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if OUT_FP32:
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _num_leaves(k: int) -> int:
    leaves = max(1, -(-k // MMA_LEAF))
    if leaves > 1 << MAX_LEVELS:
        raise ValueError(
            f"linear: K = {k} needs {leaves} leaves; the kernel holds at most {1 << MAX_LEVELS}"
        )
    return leaves


def tree_mm(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None,
    rows: torch.Tensor | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out_rows: int | None = None, tile: Tile | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight[N, K].T by the block tree; fp32 out unless `out_dtype`.

    Grouped (MoE): weight is [E, N, K], `tiles` = (expert, first row, end row) per M-tile of
    the output, `rows` [out_rows] the row of x each output row reads (None: the same row), and
    `tile` the tile the table was cut for (its BLOCK_M rows per M-tile).
    """
    k = x.shape[-1]
    if weight.shape[-1] != k:
        raise ValueError(f"linear: x has K={k}, weight [.., N, K] has K={weight.shape[-1]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    n = weight.shape[-2]
    m = x.shape[0] if out_rows is None else out_rows
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or torch.float32)
    grouped = tiles is not None
    bm, bn, warps, stages = tile or tile_for(m, n)
    n_tiles = tiles[0].numel() if grouped else triton.cdiv(m, bm)
    if m == 0 or n == 0 or n_tiles == 0:
        return out.zero_()
    dummy = out
    leaves = _num_leaves(k)
    te, ts, tend = tiles if grouped else (dummy, dummy, dummy)
    _tree_mm_kernel[(n_tiles, triton.cdiv(n, bn))](
        x, weight, out, rows if rows is not None else dummy,
        te, ts, tend, m, n, k, x.stride(0), weight.stride(0) if grouped else 0,
        weight.stride(-2), out.stride(0),
        GATHER=rows is not None, GROUPED=grouped,
        OUT_FP32=out_dtype is None, NUM_CHUNKS=max(1, -(-k // K_BLOCK)), LEAF=LEAF_CHUNKS,
        NUM_LEAVES=leaves, LEVELS=(leaves - 1).bit_length(), EVEN_K=k % K_BLOCK == 0,
        BM=bm, BN=bn, BK=K_BLOCK, IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages if x.dtype != torch.float32 else 1,
    )  # fmt: skip
    return out


def linear_partial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x @ weight.T over this weight's K: the leaf tree, no bias, not rounded."""
    return _shared.linear_partial(tree_mm, x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): the cast is fused into the kernel when there is no bias. A bias
    is added to the fp32 partial outside it (`combine_partials`): fused, the compiler may
    contract it into the last fp32 product and change the bits."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if bias is not None or grad:
        return combine_partials([linear_partial(x, weight)], x.dtype, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = tree_mm(flat, weight, out_dtype=x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, tp: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`tp` row-parallel shards plus the tree combine, in one process."""
    return _shared.row_parallel_linear(linear_partial, x, weight, tp, bias)
