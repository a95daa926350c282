"""Exact causal GQA attention (CUDA): one kernel for packed prefill, chunked prefill over a
paged cache, and decode.

A program owns one KV head and BLOCK_M query rows, a row being one (token, query head of that
KV head's group) pair, so decode packs the group's heads into one tile just as prefill packs
tokens. Keys are cut into partitions of KV_PARTITION positions at fixed absolute offsets
(0, P, 2P, ...: the same for every request, length and batch). Inside a partition the keys are
folded in KV_BLOCK-wide blocks from the partition's start, per row:
1. s = q . k by one tensor-core product over head_dim, times scale, fp32; keys past the row's
   position are -inf;
2. m' = max(m, max s); a = exp(m - m'); p = exp(s - m');
3. l_col' = l_col * a + p per key column of the block; acc' = acc * a + p . v (p rounded to
   v's dtype for the product); at the partition's end l = the pairwise tree over the columns;
4. a block holding no key <= the row's position leaves (m, l, acc) untouched;
which gives each partition's state (m, l, acc) from (-inf, 0, 0). The states of the partitions
a row sees are merged in position order, `_merge`: M = max(m, m_p), l = l e^(m - M) +
l_p e^(m_p - M), acc likewise; out = acc / l, rounded once.

Two schedules run that same arithmetic. Fused (`SPLIT` off): one program walks every partition
of its tile and merges in registers. Split: one program per (tile, KV head, partition) writes
the partition's state to a workspace, and `_merge_kernel` merges them in the same order; so a
short batch of long contexts still fills the GPU (flash-decoding, at fixed positions). Floating
point contraction is off in both kernels (`enable_fp_fusion=False`): every mul and add is
rounded on its own, so the merge's expression gives the same bits in either kernel. The tile
(rows per program, warps) may differ between launches: rows never mix inside a product, and
the denominator is summed per key column and then by the pairwise tree, never by `tl.sum`,
whose order follows the threads' layout. A row's keys are the same blocks and partitions
whether they come from the packed tensor or from pages, whichever schedule and tile run: a
token's output does not depend on the batch, the chunking, or prefill vs decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from onpolicy.kernels.compose import PagedBatch, varlen_with_native_grad
from onpolicy.kernels.compose import attention_scale as _scale
from onpolicy.kernels.rules import KV_BLOCK, cdiv

Tile = tuple[int, int, int]
"""(BLOCK_M (token, head) rows per program, warps, pipeline stages) of one launch."""

DECODE: Tile = (16, 2, 3)
"""A few new tokens per request (decode): a GQA group's heads fill the rows (two warps: 69 %
of copy bandwidth at 512 requests on an H200, against 51 % with four)."""
DECODE_FEW: Tile = (16, 8, 3)
"""The same rows for at most FEW_REQUESTS requests: few programs, so eight warps each keep more
loads in flight (graph replays of the kernel alone on an H100: 27.6 against 42.7 us for one
request over 512 keys, 46.1 against 58.3 for 8 over 4096; at 64 requests over 512 keys 55.4
against 47.8, and at 512 requests 2713 against 1654, where two warps win)."""
FEW_REQUESTS = 32
"""Decode launches of at most this many requests take DECODE_FEW. Measured at 8 requests (eight
warps ahead) and at 64 (two warps ahead over 512 keys, even over 4096: 235.1 against 235.2
us); the counts between are not, and `bench.tiles --only prefetch` sweeps 16, 32 and 48."""
PREFILL: Tile = (128, 8, 2)
"""Many new tokens per request (prefill, long chunks): 0.37-0.40 of flash SDPA on an H200,
against 0.27 with 64 rows and four warps."""
FP32: Tile = (16, 4, 2)
"""Every fp32 launch (the GPU tests' dtype; no run trains or samples in fp32): an IEEE dot is
an FMA chain that Triton unrolls over the tile, so the small tile and one variant per schedule
keep the compile short (for sm_90 on a 2-core CPU: 2.3 s fused and 1.8 s split, against
6.1 and 7.7 s at PREFILL and 4.0 and 3.6 s at DECODE)."""
FORCE: Tile | None = None
"""Tests set this to run every launch at one tile (the bits must not change)."""
PLAIN_DENOMINATOR = False
"""Test-only: the denominator by `tl.sum` instead of the column tree, the negative control of
the tile tests (its order follows the threads' layout, so the tile moves its bits)."""
UNMASKED_MIN_ROWS = 128
"""Tiles of at least this many rows run the key blocks before their first row without masks
(on an H100: packed prefill of 4096 tokens at PREFILL 1.079 against 1.282 ms, 4 x 4096
3.638 against 4.364 ms). Smaller tiles (decode) keep one masked body: with the second loop a
graph replay over 4096 keys took 32.3 against 28.6 us at one request and 370.5 against
236.0 us at 64 (`bench.tiles --only masks`, 2026-12-07)."""
MASK_EVERY_BLOCK: bool | None = None
"""Whether every key block takes the masked body. None: `masks_every_block` decides; True or
False forces it for every tile and dtype (tests and bench: the bits must not change)."""


def masks_every_block(rows: int, fp32: bool) -> bool:
    """Whether a launch at a tile of `rows` rows runs every key block through the masked body:
    tiles under UNMASKED_MIN_ROWS, and fp32 (the GPU tests' dtype; a second body nearly
    doubles an fp32 variant's compile)."""
    if MASK_EVERY_BLOCK is not None:
        return MASK_EVERY_BLOCK
    return fp32 or rows < UNMASKED_MIN_ROWS


PREFETCH: bool | None = False
"""Whether launches issue each key block's loads one block ahead (`_prefetched`). None:
`prefetches` decides; True or False forces it for every tile and dtype (tests and bench: the
bits must not change). False: on an H100 (`bench.tiles --only prefetch`) it gained 5-9 % over
512 keys and lost 24-37 % at 8 and 64 requests over 4096 keys (docs/benchmarks.md)."""


PREFETCH_MIN_WARPS = 8
"""Warps a tile needs to prefetch: the next block's K and V stay in registers beside this
block's (compiled for sm_90: 204 registers a thread at DECODE_FEW, no spills; 4 warps spill,
2 warps spill about 3 KiB a thread)."""


def prefetches(tile: Tile, fp32: bool) -> bool:
    """Whether a launch at `tile` issues its loads one block ahead: half-precision tiles of at
    least PREFETCH_MIN_WARPS warps that run the masked body on every block (decode: few
    programs, each walking its keys one dependent load after another). fp32 launches (the GPU
    tests') keep one loop."""
    if PREFETCH is not None:
        return PREFETCH
    return not fp32 and masks_every_block(tile[0], fp32) and tile[1] >= PREFETCH_MIN_WARPS


def tile_for(rows: int, requests: int, fp32: bool = False) -> Tile:
    """The tile from what the host knows (no sync): (token, head) rows, requests and dtype.
    Rows never mix inside a product, so any tile gives the same bits."""
    if FORCE is not None:
        return FORCE
    if fp32:
        return FP32
    if rows > DECODE[0] * max(requests, 1):
        return PREFILL
    return DECODE_FEW if requests <= FEW_REQUESTS else DECODE


KV_PARTITION = 512
"""Keys per partition: partitions start at absolute positions 0, 512, 1024, ... for every
request (a multiple of KV_BLOCK). Part of the bits: prefill and decode must agree on it."""

SPLIT_BELOW = 4 * 132
"""Split the partitions over programs when the fused grid (tiles x KV heads) is smaller than
this (about four programs per SM of an H200). Either schedule gives the same bits."""

_UNPAGED = 1 << 30
"""Page size that makes a packed [T, Hkv, D] tensor one page per sequence."""
BATCH_INTS = ["n_tiles", "stride_pages", "parts"]
"""Integer arguments that change with the batch, left unspecialized: Triton would compile a
variant for each value class (1, a multiple of 16, the rest), so the variants a run uses would
depend on its batches (`warmup`). They only index and mask, so the bits do not change."""


def split_for(n_tiles: int, kv_heads: int, max_keys: int) -> bool:
    """Whether a launch splits its partitions over programs (the SPLIT variant)."""
    return cdiv(max_keys, KV_PARTITION) > 1 and n_tiles * kv_heads < SPLIT_BELOW


@triton.jit
def _merge(m, denom, acc, m_p, denom_p, acc_p):
    """Partition state (m_p, denom_p, acc_p) joins the running one; m_p is finite."""
    m_new = tl.maximum(m, m_p)
    a = tl.exp(m - m_new)
    b = tl.exp(m_p - m_new)
    return m_new, denom * a + denom_p * b, acc * a[:, None] + acc_p * b[:, None]


@triton.jit
def _columns_tree(v, BM: tl.constexpr, BN: tl.constexpr, LOG_BN: tl.constexpr):
    """Row sums of v [BM, BN = 2^LOG_BN] by the pairwise tree over the columns: each level
    adds neighbouring pairs, one add per output, so the order is the data's, not the layout's
    (`tl.sum` reduces in an order that follows the threads' layout, which the tile sets)."""
    for lvl in tl.static_range(LOG_BN):
        v = tl.sum(tl.reshape(v, (BM, BN >> (lvl + 1), 2)), 2)
    return tl.reshape(v, (BM,))


@triton.jit
def _rows_of(pages_ptr, req, stride_pages, page_size, kv_base, lo, limit, BN: tl.constexpr,
             MASK: tl.constexpr):  # fmt: skip
    """The cache rows of keys [lo, lo + BN): each key's page id, then its row. MASK: keys at
    or past `limit` read page 0 (their K and V loads are masked); off, every key is read."""
    kp = lo + tl.arange(0, BN)
    pos = kp.to(tl.int32)  # positions are below 2^31: a 32-bit division, not a 64-bit call
    if MASK:
        page = tl.load(pages_ptr + req * stride_pages + pos // page_size, mask=kp < limit,
                       other=0)  # fmt: skip
    else:
        page = tl.load(pages_ptr + req * stride_pages + pos // page_size)
    return kv_base + page.to(tl.int64) * page_size + (pos % page_size).to(tl.int64)


@triton.jit
def _kv(k_ptr, v_ptr, row, lo, limit, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
        D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr):  # fmt: skip
    """K^T [D, BN] and V [BN, D] of keys [lo, lo + BN) at cache rows `row`; MASK: zeros at or
    past `limit`."""
    d = tl.arange(0, D)
    k_at = k_ptr + row[None, :] * stride_kt + kvh * stride_kh + d[:, None]
    v_at = v_ptr + row[:, None] * stride_vt + kvh * stride_vh + d[None, :]
    if MASK:
        ok = lo + tl.arange(0, BN) < limit
        kt = tl.load(k_at, mask=ok[None, :], other=0.0)
        vb = tl.load(v_at, mask=ok[:, None], other=0.0)
    else:
        kt = tl.load(k_at)
        vb = tl.load(v_at)
    return kt, vb


@triton.jit
def _block(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size, kv_base, kv_len, q_pos,
           row_ok, lo, kvh, stride_kt, stride_kh, stride_vt, stride_vh, scale, m, lcol, acc,
           D: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
           MASK: tl.constexpr):  # fmt: skip
    """One KV_BLOCK of keys from `lo` folded into (m, lcol, acc). MASK off: every key of the
    block is at or before every row's position, so the masks would keep every value and the
    same expressions give the same bits without them."""
    row = _rows_of(pages_ptr, req, stride_pages, page_size, kv_base, lo, kv_len, BN, MASK)
    kt, vb = _kv(k_ptr, v_ptr, row, lo, kv_len, kvh, stride_kt, stride_kh, stride_vt,
                 stride_vh, D, BN, MASK)  # fmt: skip
    return _fold(q, kt, vb, q_pos, row_ok, lo, scale, m, lcol, acc, BN, IEEE, MASK)


@triton.jit
def _fold(q, kt, vb, q_pos, row_ok, lo, scale, m, lcol, acc, BN: tl.constexpr,
          IEEE: tl.constexpr, MASK: tl.constexpr):  # fmt: skip
    """Steps 1 to 4 of the module's doc for the block of keys [lo, lo + BN), loaded."""
    kp = lo + tl.arange(0, BN)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee") * scale
    else:
        s = tl.dot(q, kt) * scale
    if MASK:
        valid = (kp[None, :] <= q_pos[:, None]) & row_ok[:, None]
        s = tl.where(valid, s, float("-inf"))
        live = (q_pos >= lo) & row_ok
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(live, m_new, 0.0)
        alpha = tl.exp(m - m_use)
        p = tl.where(valid, tl.exp(s - m_use[:, None]), 0.0)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
    lcol_new = lcol * alpha[:, None] + p
    if IEEE:
        acc_new = tl.dot(p, vb, acc * alpha[:, None], input_precision="ieee")
    else:
        acc_new = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None])
    if MASK:
        return (tl.where(live, m_new, m), tl.where(live[:, None], lcol_new, lcol),
                tl.where(live[:, None], acc_new, acc))  # fmt: skip
    return m_new, lcol_new, acc_new


@triton.jit
def _prefetched(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size, kv_base, kv_len,
                q_pos, row_ok, lo0, hi, kvh, stride_kt, stride_kh, stride_vt, stride_vh, scale,
                m, lcol, acc, D: tl.constexpr, BN: tl.constexpr,
                IEEE: tl.constexpr):  # fmt: skip
    """The masked blocks of [lo0, hi) with their loads issued ahead: the next block's K and V
    and the one after's page ids are in flight while a block's products run (an indirect
    load, which Triton's pipeliner leaves in place at decode's depths). A block that is
    folded loads exactly what `_block` loads; the loads past the last block are masked off."""
    row = _rows_of(pages_ptr, req, stride_pages, page_size, kv_base, lo0, kv_len, BN, True)
    kt, vb = _kv(k_ptr, v_ptr, row, lo0, kv_len, kvh, stride_kt, stride_kh, stride_vt,
                 stride_vh, D, BN, True)  # fmt: skip
    lim = tl.where(lo0 + BN < hi, kv_len, 0)
    row = _rows_of(pages_ptr, req, stride_pages, page_size, kv_base, lo0 + BN, lim, BN, True)
    for lo in range(lo0, hi, BN):
        lim = tl.where(lo + BN < hi, kv_len, 0)
        kt_next, vb_next = _kv(k_ptr, v_ptr, row, lo + BN, lim, kvh, stride_kt, stride_kh,
                               stride_vt, stride_vh, D, BN, True)  # fmt: skip
        lim = tl.where(lo + 2 * BN < hi, kv_len, 0)
        row = _rows_of(pages_ptr, req, stride_pages, page_size, kv_base, lo + 2 * BN, lim, BN,
                       True)  # fmt: skip
        m, lcol, acc = _fold(q, kt, vb, q_pos, row_ok, lo, scale, m, lcol, acc, BN, IEEE,
                             True)  # fmt: skip
        kt, vb = kt_next, vb_next
    return m, lcol, acc


@triton.jit
def _partition(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size, kv_base, kv_len,
               q_pos, row_ok, first_pos, lo0, hi, kvh, stride_kt, stride_kh, stride_vt,
               stride_vh, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               LOG_BN: tl.constexpr, IEEE: tl.constexpr, PLAIN: tl.constexpr,
               MASK_ALL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """The state (m, l, acc) of keys [lo0, hi) for each row, from (-inf, 0, 0). The blocks
    that end at or before the tile's first row (`first_pos`, the smallest position) need no
    mask; the causal edge's blocks (one or two in prefill, the last in decode) do."""
    m = tl.full((BM,), float("-inf"), tl.float32)
    lcol = tl.zeros((BM, BN), tl.float32)  # the denominator, per key column of the block
    acc = tl.zeros((BM, D), tl.float32)
    if PREFETCH:  # the masked body on every block, its loads one block ahead
        m, lcol, acc = _prefetched(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size,
                                   kv_base, kv_len, q_pos, row_ok, lo0, hi, kvh, stride_kt,
                                   stride_kh, stride_vt, stride_vh, scale, m, lcol, acc, D,
                                   BN, IEEE)  # fmt: skip
    else:
        if MASK_ALL:  # the masked body everywhere (`masks_every_block`), the same bits
            mid = lo0
        else:
            mid = tl.minimum(lo0 + tl.maximum(first_pos + 1 - lo0, 0) // BN * BN, hi)
        for lo in range(lo0, mid, BN):
            m, lcol, acc = _block(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size,
                                  kv_base, kv_len, q_pos, row_ok, lo, kvh, stride_kt,
                                  stride_kh, stride_vt, stride_vh, scale, m, lcol, acc, D, BN,
                                  IEEE, False)  # fmt: skip
        for lo in range(mid, hi, BN):
            m, lcol, acc = _block(q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size,
                                  kv_base, kv_len, q_pos, row_ok, lo, kvh, stride_kt,
                                  stride_kh, stride_vt, stride_vh, scale, m, lcol, acc, D, BN,
                                  IEEE, True)  # fmt: skip
    if PLAIN:  # the test-only control: an order the layout picks
        return m, tl.sum(lcol, 1), acc
    return m, _columns_tree(lcol, BM, BN, LOG_BN), acc


@triton.jit(do_not_specialize=BATCH_INTS)
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, ws_ptr, sched_ptr, n_tiles, pages_ptr, stride_pages, page_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    LOG_BN: tl.constexpr, P: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    PLAIN: tl.constexpr, MASK_ALL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pid, kvh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = tl.load(sched_ptr + pid)  # the schedule: 6 rows of n_tiles int64 (see _schedule)
    if req < 0:
        return
    f0 = tl.load(sched_ptr + n_tiles + pid)
    q0 = tl.load(sched_ptr + 2 * n_tiles + pid)
    n_new = tl.load(sched_ptr + 3 * n_tiles + pid)
    kv_len = tl.load(sched_ptr + 4 * n_tiles + pid)
    kv_base = tl.load(sched_ptr + 5 * n_tiles + pid)
    f = f0 + tl.arange(0, BM)
    tok, head = f // G, f % G
    row_ok = tok < n_new
    q_pos = kv_len - n_new + tok
    d = tl.arange(0, D)
    q_rows = (q0 + tok).to(tl.int64) * stride_qt + (kvh * G + head) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    first_pos = kv_len - n_new + f0 // G
    last_tok = tl.minimum((f0 + BM - 1) // G, n_new - 1)
    hi = kv_len - n_new + last_tok + 1
    if SPLIT:  # this program's partition only; its state goes to the workspace
        lo0 = part * P
        if lo0 >= hi:
            return
        m, denom, acc = _partition(
            q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size, kv_base, kv_len, q_pos,
            row_ok, first_pos, lo0, tl.minimum(lo0 + P, hi), kvh, stride_kt, stride_kh,
            stride_vt, stride_vh, scale, D, BM, BN, LOG_BN, IEEE, PLAIN, MASK_ALL, PREFETCH,
        )  # fmt: skip
        at = ((pid * tl.num_programs(1) + kvh) * tl.num_programs(2) + part).to(tl.int64)
        st = ws_ptr + at * BM * (D + 2)
        ok = row_ok & (q_pos >= lo0)
        tl.store(st + tl.arange(0, BM), m, mask=ok)
        tl.store(st + BM + tl.arange(0, BM), denom, mask=ok)
        tl.store(st + 2 * BM + tl.arange(0, BM)[:, None] * D + d[None, :], acc,
                 mask=ok[:, None])  # fmt: skip
    else:
        # Partition 0 merges into (-inf, 0, 0) like the others: that merge gives its state
        # exactly (x * 0 + y * 1, y never -0), and one inlined `_partition` compiles in about
        # 40 % less time than a peeled first one (docs/benchmarks.md).
        m = tl.full((BM,), float("-inf"), tl.float32)
        denom = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        for lo0 in range(0, hi, P):
            m_p, denom_p, acc_p = _partition(
                q, k_ptr, v_ptr, pages_ptr, req, stride_pages, page_size, kv_base, kv_len,
                q_pos, row_ok, first_pos, lo0, tl.minimum(lo0 + P, hi), kvh, stride_kt,
                stride_kh, stride_vt, stride_vh, scale, D, BM, BN, LOG_BN, IEEE, PLAIN, MASK_ALL,
                PREFETCH,
            )  # fmt: skip
            m_j, denom_j, acc_j = _merge(m, denom, acc, m_p, denom_p, acc_p)
            sees = q_pos >= lo0
            m = tl.where(sees, m_j, m)
            denom = tl.where(sees, denom_j, denom)
            acc = tl.where(sees[:, None], acc_j, acc)
        out = acc / denom[:, None]
        o_rows = (q0 + tok).to(tl.int64) * stride_ot + (kvh * G + head) * stride_oh
        tl.store(o_ptr + o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip


@triton.jit(do_not_specialize=BATCH_INTS)
def _merge_kernel(
    o_ptr, ws_ptr, sched_ptr, n_tiles, stride_ot, stride_oh,
    parts, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """The split schedule's end: a (tile, KV head)'s partition states merged in order."""
    pid, kvh = tl.program_id(0), tl.program_id(1)
    req = tl.load(sched_ptr + pid)
    if req < 0:
        return
    f0 = tl.load(sched_ptr + n_tiles + pid)
    q0 = tl.load(sched_ptr + 2 * n_tiles + pid)
    n_new = tl.load(sched_ptr + 3 * n_tiles + pid)
    kv_len = tl.load(sched_ptr + 4 * n_tiles + pid)
    f = f0 + tl.arange(0, BM)
    tok, head = f // G, f % G
    row_ok = tok < n_new
    q_pos = kv_len - n_new + tok
    d = tl.arange(0, D)
    r = tl.arange(0, BM)
    base = ((pid * tl.num_programs(1) + kvh) * parts).to(tl.int64) * BM * (D + 2)
    m = tl.load(ws_ptr + base + r, mask=row_ok, other=0.0)
    denom = tl.load(ws_ptr + base + BM + r, mask=row_ok, other=1.0)
    acc = tl.load(ws_ptr + base + 2 * BM + r[:, None] * D + d[None, :], mask=row_ok[:, None],
                  other=0.0)  # fmt: skip
    last_tok = tl.minimum((f0 + BM - 1) // G, n_new - 1)
    hi = kv_len - n_new + last_tok + 1
    for part in range(1, tl.cdiv(hi, P)):
        sees = row_ok & (q_pos >= part * P)
        st = ws_ptr + base + part * BM * (D + 2)
        m_p = tl.load(st + r, mask=sees, other=0.0)
        denom_p = tl.load(st + BM + r, mask=sees, other=0.0)
        acc_p = tl.load(st + 2 * BM + r[:, None] * D + d[None, :], mask=sees[:, None], other=0.0)
        m_j, denom_j, acc_j = _merge(m, denom, acc, m_p, denom_p, acc_p)
        m = tl.where(sees, m_j, m)
        denom = tl.where(sees, denom_j, denom)
        acc = tl.where(sees[:, None], acc_j, acc)
    out = acc / denom[:, None]
    o_rows = (q0 + tok).to(tl.int64) * stride_ot + (kvh * G + head) * stride_oh
    tl.store(o_ptr + o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip


def _schedule(q_starts, n_new, kv_lens, kv_base, g: int, n_tokens: int, dev,
              bm: int) -> torch.Tensor:  # fmt: skip
    """[6, n_tiles] int64 on `dev`: per M-tile its request (-1: unused), first row, and the
    request's first token, new tokens, keys and base row. Built on the device from device
    tensors (no host sync; n_tiles is the bound n_tokens * g / BLOCK_M + requests), or on the
    host from lists (one copy)."""
    if isinstance(n_new, torch.Tensor):
        r = n_new.numel()
        if r == 0:
            return torch.empty(6, 0, dtype=torch.int64, device=dev)
        per = (n_new * g + bm - 1) // bm
        ends = torch.cumsum(per, 0)
        slots = torch.arange(n_tokens * g // bm + r, device=dev)
        req = torch.searchsorted(ends, slots, right=True)
        rc = req.clamp(max=r - 1)
        row = (slots - (ends - per)[rc]) * bm
        cols = [torch.where(req < r, req, -1), row, q_starts[rc], n_new[rc], kv_lens[rc],
                kv_base[rc]]  # fmt: skip
        return torch.stack([c.to(torch.int64) for c in cols])
    rows: list[list[int]] = [[], [], [], [], [], []]
    for i, n in enumerate(n_new):
        for f0 in range(0, n * g, bm):
            for col, val in zip(rows, (i, f0, q_starts[i], n, kv_lens[i], kv_base[i]),
                                strict=True):  # fmt: skip
                col.append(val)
    return torch.tensor(rows, dtype=torch.int64).to(dev)


def _launch(q, k_rows, v_rows, sched, pages, page_size, scale, max_keys: int, tile: Tile):
    """q [T, Hq, D]; k_rows, v_rows [rows, Hkv, D]; the schedule (cut for `tile`); pages
    [R, P] on device; max_keys bounds every request's keys (it sizes the split grid)."""
    t, hq, d = q.shape
    hkv = k_rows.shape[1]
    g = hq // hkv
    bm, warps, stages = tile
    out = torch.empty_like(q)
    n_tiles = sched.shape[1]
    if n_tiles == 0 or t == 0:
        return out
    parts = max(1, cdiv(max_keys, KV_PARTITION))
    split = split_for(n_tiles, hkv, max_keys)
    ws = (torch.empty(n_tiles * hkv * parts * bm * (d + 2), dtype=torch.float32,
                      device=q.device) if split else out)  # fmt: skip
    fp32 = q.dtype == torch.float32
    mask_all = masks_every_block(bm, fp32)
    common = dict(G=g, D=d, BM=bm, num_warps=warps, enable_fp_fusion=False)
    _attn_kernel[(n_tiles, hkv, parts if split else 1)](
        q, k_rows, v_rows, out, ws, sched, n_tiles, pages, pages.stride(0), page_size,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1),
        v_rows.stride(0), v_rows.stride(1), out.stride(0), out.stride(1),
        scale, BN=KV_BLOCK, LOG_BN=KV_BLOCK.bit_length() - 1, P=KV_PARTITION, SPLIT=split,
        IEEE=fp32, PLAIN=PLAIN_DENOMINATOR, MASK_ALL=mask_all,
        PREFETCH=prefetches(tile, fp32), num_stages=stages, **common,
    )  # fmt: skip
    if split:
        _merge_kernel[(n_tiles, hkv)](
            out, ws, sched, n_tiles, out.stride(0), out.stride(1), parts, P=KV_PARTITION,
            **common,
        )  # fmt: skip
    return out


def _check_shapes(q: torch.Tensor, hkv: int) -> None:
    hq, d = q.shape[1], q.shape[2]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {hkv} kv heads")
    if d < 16 or d & (d - 1):
        raise ValueError(f"attention: head_dim {d} must be a power of 2 >= 16 on CUDA")


def _host_ints(xs) -> list[int]:
    return [int(x) for x in (xs.tolist() if isinstance(xs, torch.Tensor) else xs)]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _varlen_exact(q, k, v, cu_seqlens, scale):
    cu = _host_ints(cu_seqlens)
    _check_shapes(q, k.shape[1])
    starts, lens = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    g = q.shape[1] // k.shape[1]
    tile = tile_for(q.shape[0] * g, len(lens), q.dtype == torch.float32)
    sched = _schedule(starts, lens, lens, starts, g, q.shape[0], q.device, tile[0])
    pages = torch.zeros(1, 1, dtype=torch.int64, device=q.device)
    return _launch(_rows(q), _rows(k), _rows(v), sched, pages[:, :1].expand(len(lens), 1),
                   _UNPAGED, scale, max(lens, default=0), tile)  # fmt: skip


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k, v [T, Hkv, D]; the gradient is
    the native SDPA's."""
    return varlen_with_native_grad(_varlen_exact, q, k, v, cu_seqlens, scale)


class _Plan(NamedTuple):
    """What a launch derives from a `PagedBatch`: the same for every layer of the forward."""

    sched: torch.Tensor
    pages: torch.Tensor
    max_keys: int


def _plan(batch: PagedBatch, t: int, g: int, page_size: int, tile: Tile, dev) -> _Plan | None:
    """The batch's schedule for t new tokens of g query heads a KV head, cut for `tile`; None:
    no keys."""
    cu_q, tables, kv_lens = batch.cu_seqlens_q, batch.page_tables, batch.kv_lens
    on_device = (isinstance(tables, torch.Tensor) and isinstance(kv_lens, torch.Tensor)
                 and isinstance(cu_q, torch.Tensor) and kv_lens.is_cuda
                 and cu_q.is_cuda)  # fmt: skip
    if on_device:
        pages = tables.to(dev, torch.int64)
        if pages.shape[1] == 0:
            return None
        cu = cu_q.to(torch.int64)
        n_new = cu[1:] - cu[:-1]
        lens = kv_lens.to(torch.int64)
        sched = _schedule(cu[:-1], n_new, lens, torch.zeros_like(lens), g, t, dev, tile[0])
        return _Plan(sched, pages, pages.shape[1] * page_size)
    cu = _host_ints(cu_q)
    if len(cu) < 2:
        return None
    lens = _host_ints(kv_lens)
    n_new = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if isinstance(tables, torch.Tensor):
        pages = tables.to(dev, torch.int64)
        widths = [pages.shape[1]] * pages.shape[0]
    else:
        tabs = [torch.as_tensor(x, device=dev).long() for x in tables]
        widths = [x.numel() for x in tabs]
        same = len(set(widths)) == 1
        pages = torch.stack(tabs) if same else torch.nn.utils.rnn.pad_sequence(tabs, True)
    if pages.shape[1] == 0:
        pages = torch.zeros(len(n_new), 1, dtype=torch.int64, device=dev)
    for i, (n, kv, w) in enumerate(zip(n_new, lens, widths, strict=True)):
        if n > kv:
            raise ValueError(f"attention: {n} new tokens but only {kv} keys in the cache")
        if w * page_size < kv:
            raise ValueError(f"paged_attention: request {i} has {kv} keys but {w} pages")
    sched = _schedule(cu[:-1], n_new, lens, [0] * len(lens), g, t, dev, tile[0])
    return _Plan(sched, pages, max(lens, default=0))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: PagedBatch,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over a paged cache [num_pages, page_size, Hkv, D]; the
    new tokens of request i sit at positions kv_lens[i] - n_new .. kv_lens[i] - 1.

    The launch schedule is derived from the batch once (about twenty small torch kernels on
    the device path, a check and a copy on the host path) and kept in `batch.derived`: the
    other layers of the forward launch the kernel alone. Given as CUDA tensors (a decode step
    with no host sync) the page count bounds the keys; given as lists, they are checked."""
    num_pages, page_size, hkv, d = k_pages.shape
    _check_shapes(q, hkv)
    g = q.shape[1] // hkv
    tile = tile_for(q.shape[0] * g, len(batch.cu_seqlens_q) - 1, q.dtype == torch.float32)
    key = ("cuda", q.shape[0], g, page_size, tile, q.device)
    if key not in batch.derived:
        batch.derived[key] = _plan(batch, q.shape[0], g, page_size, tile, q.device)
    plan = batch.derived[key]
    if plan is None:
        return q.new_zeros(q.shape)
    k_rows = k_pages.reshape(num_pages * page_size, hkv, d)
    v_rows = v_pages.reshape(num_pages * page_size, hkv, d)
    return _launch(_rows(q), k_rows, v_rows, plan.sched, plan.pages, page_size,
                   _scale(q, scale), plan.max_keys, tile)  # fmt: skip
