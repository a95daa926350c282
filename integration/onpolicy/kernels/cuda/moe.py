"""Exact MoE (CUDA): the router, a grouped segment GEMM over the touched experts, the
combine.

- Router: the exact linear, then one program per token (`_route_kernel`): fp32 softmax whose
  sum is the pairwise tree over the experts, top-k by repeated arg-max with ties to the lower
  id (a stable descending sort's order), renormalised by the tree over the k weights.
- Experts: `tree_mm` in grouped mode, the same kernel and segments as `linear`, reading each
  row of x by index, so a row's bits are those of `linear` on that row alone. Small batches
  (at most SMALL_PAIRS (token, slot) pairs) give every pair its own M-tile, the kernel reading
  the pair's expert from the ids: no sort, only the touched experts' weights are read. Larger
  ones sort the pairs by expert (stably) and cut each expert's rows into tiles (linear's for
  their rows, or SMALL_TILE up to SORTED_SMALL_TILE_MAX_PAIRS), the schedule in one launch up
  to SCHEDULE_MAX_PAIRS pairs (`_schedule_kernel`, a counting sort that gives `torch.sort`'s
  stable order; ONE_LAUNCH_SCHEDULE), by torch ops above. A row's bits never depend on the
  schedule, which only decides where the row is computed. Gate and up are one launch, then
  the down projection (K in the run's expert segments), which stores each row at its pair's
  place; up to SWIGLU_ON_LOAD_MAX_PAIRS pairs it computes silu_mul(gate, up)'s rows as it loads
  them (`silu_mul`'s steps and rounding), above it reads `silu_mul`'s.
- Combine: one program per token (`_combine_kernel`): the slots in ascending expert-id order,
  weight * output in fp32, the pairwise tree of 1, 2, 4 or 8 terms written out, rounded once:
  the CPU backend's torch ops, step for step. Merge: the shared selection.
The route kernel needs power-of-2 expert and slot counts and the combine 1, 2, 4 or 8 slots;
other counts run the shared torch ops. Gradients are the torch ops'.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import triton
import triton.language as tl

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.compose import combine as _torch_combine
from onpolicy.kernels.compose import route_from_logits
from onpolicy.kernels.cuda import linear as _linear
from onpolicy.kernels.cuda.elementwise import silu_mul
from onpolicy.kernels.cuda.linear import linear, tree_mm
from onpolicy.kernels.rules import cdiv, check_segments, is_power_of_2, next_power_of_2

__all__ = ["combine", "expert_outputs", "route"]


SMALL_PAIRS = 64
"""Up to this many (token, slot) pairs, each pair is its own M-tile (decode-sized batches)."""

SWIGLU_ON_LOAD_MAX_PAIRS = 0
"""Up to this many pairs the down projection computes SiLU-mul as it loads its rows; above, the
`silu_mul` kernel writes them first. Either gives the same bits. Every N-tile of the GEMM
repeats the SiLU of its rows (the exp and the division of a 16-row tile's padding rows too),
so it is 0, the kernel always: on an H100 the MoE layer took 65.7 against 57.8 us at one token
and 951.7 against 523.2 us at 64 with it (docs/benchmarks.md)."""

SMALL_TILE = (16, 64, 128, 4, 4)
"""The per-pair tile: 16 rows (one used), as few as the tensor core takes. Same bits as any
other tile (`tests/gpu/test_cuda_kernels.py`)."""

SORTED_SMALL_TILE_MAX_PAIRS = 0
"""Up to this many pairs the sorted path's GEMMs run SMALL_TILE, not linear's tile for their
rows: past SMALL_PAIRS an expert holds a few rows (4 on average at 512 pairs over 128
experts), so a 64-row tile mostly multiplies padding. Same bits as any tile. 0, linear's tile:
on an H100 the MoE layer at 512 pairs took 499.2 us with every launch at SMALL_TILE against
530.1 at linear's tiles, with the torch ops' schedule; with the one-launch schedule it is not
yet timed (`bench.tiles --only schedule`). The engine warm-up steps at its bound."""


@triton.jit
def _tree(v, N: tl.constexpr, LOG: tl.constexpr):
    """Pairwise tree sum of v [N] (N = 2^LOG): neighbours added level by level."""
    for lvl in tl.static_range(LOG):
        v = tl.sum(tl.reshape(v, (N >> (lvl + 1), 2)), 1)
    return tl.reshape(v, ())


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, stride, E: tl.constexpr, LOG_E: tl.constexpr,
                  K: tl.constexpr, LOG_K: tl.constexpr, RENORM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    x = tl.load(logits_ptr + t * stride + e).to(tl.float32)
    ex = tl.exp(x - tl.max(x, 0))
    probs = ex / _tree(ex, E, LOG_E)
    kk = tl.arange(0, K)
    ids = tl.zeros((K,), tl.int64)
    w = tl.zeros((K,), tl.float32)
    for i in tl.static_range(K):  # the best left, the lowest id among equals
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, e, E), 0)
        ids = tl.where(kk == i, idx, ids)
        w = tl.where(kk == i, best, w)
        probs = tl.where(e == idx, -1.0, probs)
    if RENORM:
        w = w / _tree(w, K, LOG_K)
    tl.store(ids_ptr + t * K + kk, ids)
    tl.store(w_ptr + t * K + kk, w)


def _route_exact(logits: torch.Tensor, top_k: int, renormalize: bool):
    t, e = logits.shape
    logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, w, logits.stride(0), E=e, LOG_E=e.bit_length() - 1,
                            K=top_k, LOG_K=top_k.bit_length() - 1, RENORM=renormalize,
                            enable_fp_fusion=False)  # fmt: skip
    return ids, w


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32), best first, ties to the lower id."""
    logits = linear(x, gate_weight)
    e = logits.shape[-1]
    if not (is_power_of_2(e) and is_power_of_2(top_k) and top_k <= e):
        return route_from_logits(logits, top_k, renormalize)
    flat = logits.reshape(-1, e)
    ids, w = _route_exact(flat.detach(), top_k, renormalize)
    weights = exact_with_native_grad(
        lambda _: w, lambda lg: route_from_logits(lg, top_k, renormalize)[1], flat
    )
    return ids.view(*logits.shape[:-1], top_k), weights.view(*logits.shape[:-1], top_k)


@triton.jit
def _slot_term(y_ptr, w_ptr, t, slot, kk, i: tl.constexpr, h, H, K: tl.constexpr):
    """weight * output in fp32 of the slot at place i of the ascending id order."""
    s = tl.sum(tl.where(kk == i, slot, 0), 0)
    w = tl.load(w_ptr + t * K + s)
    y = tl.load(y_ptr + (t * K + s) * H + h, mask=h < H, other=0.0)
    return w * y.to(tl.float32)


@triton.jit
def _combine_kernel(out_ptr, y_ptr, ids_ptr, w_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    """One token's slots in ascending expert-id order (stable), added by the pairwise tree of
    1, 2, 4 or 8 terms spelled out: every add is one pair, in no layout's order."""
    t = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, K)
    ids = tl.load(ids_ptr + t * K + kk)
    a, b = ids[:, None], ids[None, :]
    before = (b < a) | ((b == a) & (kk[None, :] < kk[:, None]))
    rank = tl.sum(before.to(tl.int32), 1)  # the slot's place in ascending id order (stable)
    slot = tl.sum(tl.where(rank[None, :] == kk[:, None], kk[None, :], 0), 1)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        v = _slot_term(y_ptr, w_ptr, t, slot, kk, 0, h, H, K)
        if K >= 2:
            v = v + _slot_term(y_ptr, w_ptr, t, slot, kk, 1, h, H, K)
        if K >= 4:
            v = v + (_slot_term(y_ptr, w_ptr, t, slot, kk, 2, h, H, K)
                     + _slot_term(y_ptr, w_ptr, t, slot, kk, 3, h, H, K))  # fmt: skip
        if K == 8:
            v = v + ((_slot_term(y_ptr, w_ptr, t, slot, kk, 4, h, H, K)
                      + _slot_term(y_ptr, w_ptr, t, slot, kk, 5, h, H, K))
                     + (_slot_term(y_ptr, w_ptr, t, slot, kk, 6, h, H, K)
                        + _slot_term(y_ptr, w_ptr, t, slot, kk, 7, h, H, K)))  # fmt: skip
        tl.store(out_ptr + t * H + h, v.to(out_ptr.dtype.element_ty), mask=h < H)


COMBINE_SLOTS = (1, 2, 4, 8)
"""Slot counts the combine kernel spells out; others run the shared torch combine."""


def _combine_exact(outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    t, k, h = outputs.shape
    out = torch.empty(t, h, dtype=outputs.dtype, device=outputs.device)
    if t and h:
        _combine_kernel[(t,)](
            out, outputs.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(),
            h, K=k, BH=min(1024, next_power_of_2(h)), num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


def combine(
    outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """sum_slots weight * output in ascending expert-id order, fp32 tree, rounded to outputs'
    dtype. outputs [T, k, H], topk_ids / topk_weights [T, k]."""
    if outputs.shape[1] not in COMBINE_SLOTS:
        return _torch_combine(outputs, topk_ids, topk_weights)
    return exact_with_native_grad(
        lambda o, w: _combine_exact(o, topk_ids, w),
        lambda o, w: _torch_combine(o, topk_ids, w),
        outputs, topk_weights,
    )  # fmt: skip


def _tiles(expert_of_pair: torch.Tensor, num_experts: int, bm: int):
    """The grouped GEMM's schedule by torch ops, built on the device without a host sync.

    Returns (order, (tile_expert, tile_start, tile_end)): `order` sorts the pairs by expert
    (pairs of experts >= num_experts go last and get no tile); tile i covers sorted rows
    [tile_start, tile_end) of expert tile_expert (-1: an unused tile, the grid's slack).
    """
    n = expert_of_pair.numel()
    order = torch.sort(expert_of_pair, stable=True).indices
    # A scatter-add, not bincount: bincount reads the max id on the host (a sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_of_pair.device)
    counts = counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    per = (counts + bm - 1) // bm
    first = torch.cumsum(per, 0) - per
    slots = torch.arange(cdiv(n, bm) + num_experts, device=counts.device)
    e = torch.searchsorted(torch.cumsum(per, 0), slots, right=True)
    ec = e.clamp(max=num_experts - 1)
    tile_start = starts[ec] + (slots - first[ec]) * bm
    tile_end = starts[ec] + counts[ec]
    tile_expert = torch.where(e < num_experts, e, -1)
    return order, (tile_expert, tile_start, tile_end)


ONE_LAUNCH_SCHEDULE = True
"""Whether the sorted path builds its schedule in one launch (`_schedule_launch`, up to
SCHEDULE_MAX_PAIRS pairs) rather than by `_tiles`' torch ops (a sort and about twenty small
kernels). Both give the same order, rows and tiles entry for entry; on an H100 the launch took
16-19 us where the torch ops took 86-95 (M = 64 to 512 tokens at Qwen3-30B-A3B's router), so
off only to compare the two (`bench.tiles --only schedule`)."""

SCHEDULE_MAX_PAIRS = 4096
"""Pairs `_schedule_kernel` takes at most: every program reads all the pairs' ids."""

SCHEDULE_CHUNK = 32
"""Pairs (or tile slots) per program of `_schedule_kernel`."""


@triton.jit
def _gather(values, bins, at):
    """values[at] for values [E2] and at [C]: the one bin that matches, summed."""
    return tl.sum(tl.where(bins[None, :] == at[:, None], values[None, :], 0), 1)


@triton.jit(do_not_specialize=["n", "n_chunks", "n_slots"])
def _schedule_kernel(ids_ptr, order_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr,
                     tile_end_ptr, n, k, bm, n_chunks, n_slots, NE: tl.constexpr,
                     E2: tl.constexpr, NP: tl.constexpr, C: tl.constexpr):  # fmt: skip
    """`_tiles`' schedule and the rows of x (pair // k) in one launch, no host sync. Programs
    below n_chunks place C pairs each at their stably sorted place: their expert's start, the
    pairs of that expert in earlier chunks, and those before them in their own chunk. The
    others write C tile slots each. Every program counts the pairs per expert (ids in [0, NE],
    NE the non-local pairs, which sort last and get no tile) over all n <= NP pairs."""
    pid = tl.program_id(0)
    bins = tl.arange(0, E2)
    i = tl.arange(0, NP)
    ids = tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int32)
    counts = tl.histogram(ids, E2, mask=i < n)
    starts = tl.cumsum(counts, 0) - counts
    if pid < n_chunks:
        c0 = pid * C
        before = tl.histogram(ids, E2, mask=i < c0)
        j = c0 + tl.arange(0, C)
        mine = tl.load(ids_ptr + j, mask=j < n, other=0).to(tl.int32)
        same = (mine[:, None] == mine[None, :]) & (j[None, :] < j[:, None])
        pos = _gather(starts + before, bins, mine) + tl.sum(same.to(tl.int32), 1)
        tl.store(order_ptr + pos, j.to(tl.int64), mask=j < n)
        tl.store(rows_ptr + pos, (j // k).to(tl.int64), mask=j < n)
    else:
        per = tl.where(bins < NE, (counts + bm - 1) // bm, 0)
        cum = tl.cumsum(per, 0)
        s = (pid - n_chunks) * C + tl.arange(0, C)
        # searchsorted(cum[:NE], s, right=True): the experts whose tiles end at or before s
        e = tl.sum(((cum[None, :] <= s[:, None]) & (bins[None, :] < NE)).to(tl.int32), 1)
        ec = tl.minimum(e, NE - 1)
        start = _gather(starts, bins, ec)
        tl.store(tile_start_ptr + s, (start + (s - _gather(cum - per, bins, ec)) * bm)
                 .to(tl.int64), mask=s < n_slots)  # fmt: skip
        tl.store(tile_end_ptr + s, (start + _gather(counts, bins, ec)).to(tl.int64),
                 mask=s < n_slots)  # fmt: skip
        tl.store(tile_expert_ptr + s, tl.where(e < NE, e, -1).to(tl.int64), mask=s < n_slots)


def _schedule(ids: torch.Tensor, num_experts: int, k: int, bm: int):
    """(order, rows, (tile_expert, tile_start, tile_end)): `_tiles`' schedule and each sorted
    pair's row of x (pair // k); one launch with ONE_LAUNCH_SCHEDULE up to SCHEDULE_MAX_PAIRS
    pairs."""
    if ONE_LAUNCH_SCHEDULE and ids.numel() <= SCHEDULE_MAX_PAIRS:
        return _schedule_launch(ids, num_experts, k, bm)
    return _schedule_torch(ids, num_experts, k, bm)


def _schedule_torch(ids: torch.Tensor, num_experts: int, k: int, bm: int):
    """`_schedule` by `_tiles`' torch ops."""
    order, tiles = _tiles(ids, num_experts, bm)
    return order, order // k, tiles


def _schedule_launch(ids: torch.Tensor, num_experts: int, k: int, bm: int):
    """`_schedule` by `_schedule_kernel`, for at most SCHEDULE_MAX_PAIRS pairs."""
    n = ids.numel()
    if n > SCHEDULE_MAX_PAIRS:
        raise ValueError(f"moe schedule: {n} pairs; one launch takes at most "
                         f"SCHEDULE_MAX_PAIRS = {SCHEDULE_MAX_PAIRS}")  # fmt: skip
    n_slots = cdiv(n, bm) + num_experts
    order, rows = (torch.empty(n, dtype=torch.int64, device=ids.device) for _ in range(2))
    tiles = tuple(torch.empty(n_slots, dtype=torch.int64, device=ids.device) for _ in range(3))
    n_chunks = cdiv(n, SCHEDULE_CHUNK)
    _schedule_kernel[(n_chunks + cdiv(n_slots, SCHEDULE_CHUNK),)](
        ids.contiguous(), order, rows, *tiles, n, k, bm, n_chunks, n_slots, NE=num_experts,
        E2=next_power_of_2(num_experts + 1), NP=SCHEDULE_MAX_PAIRS, C=SCHEDULE_CHUNK,
        num_warps=4,
    )  # fmt: skip
    return order, rows, tiles


def expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    local_experts: Sequence[int] | None = None,
    segments: int = 1,
) -> torch.Tensor:
    """[T, k, H] SwiGLU output of each (token, slot)'s expert, in x's dtype; slots whose expert
    is not in `local_experts` (default: all) stay zero; the down projection's K in `segments`.
    The gradient is a per-expert torch loop's."""
    check_segments(w_down.shape[-1], segments)
    return exact_with_native_grad(
        lambda *a: _expert_outputs_exact(*a, topk_ids, local_experts, segments),
        lambda *a: _expert_outputs_native(*a, topk_ids, local_experts),
        x, w_gate, w_up, w_down,
    )  # fmt: skip


def _expert_outputs_native(x, w_gate, w_up, w_down, topk_ids, local_experts):
    t, k = topk_ids.shape
    out = x.new_zeros(t, k, w_down.shape[1])
    for e in range(w_gate.shape[0]) if local_experts is None else local_experts:
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel():
            xe = x[tok].float()
            h = torch.nn.functional.silu(xe @ w_gate[e].float().T) * (xe @ w_up[e].float().T)
            out = out.index_put((tok, slot), (h @ w_down[e].float().T).to(x.dtype))
    return out


_LOCAL_MASKS: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}


def _is_local(ids: torch.Tensor, local_experts: Sequence[int], num_experts: int) -> torch.Tensor:
    """Which of `ids` (in [0, num_experts]) name a local expert. Inside a CUDA-graph capture
    nothing here may copy from the host or sync (SGLang's decode capture failed on both): a
    contiguous range is two comparisons with scalars; any other set is a mask made on the
    first, eager call (SGLang warms up before it captures) and gathered from after."""
    if isinstance(local_experts, range) and local_experts.step == 1:
        return (ids >= local_experts.start) & (ids < local_experts.stop)
    key = (tuple(int(e) for e in local_experts), num_experts, torch.device(ids.device))
    mask = _LOCAL_MASKS.get(key)
    if mask is None:
        mask = torch.zeros(num_experts + 1, dtype=torch.bool)
        mask[list(key[0])] = True
        mask = _LOCAL_MASKS[key] = mask.to(ids.device)
    return mask[ids]


def _down_rows(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The down projection's operand and the up rows it combines on load: (gate, up), or
    silu_mul's rows written out and None (SWIGLU_ON_LOAD_MAX_PAIRS)."""
    if gate.shape[0] <= SWIGLU_ON_LOAD_MAX_PAIRS:
        return gate, up
    return silu_mul(gate, up), None


def _sorted_tile(pairs: int, cols: int, segments: int):
    """The sorted path's GEMM tile: SMALL_TILE up to SORTED_SMALL_TILE_MAX_PAIRS pairs (unless a
    test forces every launch's tile), linear's above."""
    if _linear.FORCE is None and pairs <= SORTED_SMALL_TILE_MAX_PAIRS:
        return SMALL_TILE
    return _linear.tile_for(pairs, cols, segments, tma=False)


def _expert_outputs_exact(x, w_gate, w_up, w_down, topk_ids, local_experts, segments):
    t, k = topk_ids.shape
    num_experts, hidden = w_gate.shape[0], w_down.shape[1]
    ids = topk_ids.reshape(-1).long()
    if local_experts is not None:
        ids = torch.where(_is_local(ids, local_experts, num_experts), ids, num_experts)
    if ids.numel() == 0:
        return x.new_zeros(t, k, hidden)
    n = ids.numel()
    # Rows of non-local pairs are never computed, so they keep the zeros they start with.
    out = (torch.empty if local_experts is None else torch.zeros)(n, hidden, dtype=x.dtype,
                                                                    device=x.device)  # fmt: skip
    gate = torch.empty(n, w_gate.shape[1], dtype=x.dtype, device=x.device)
    if n <= SMALL_PAIRS:  # one M-tile per pair, in pair order: no sort, no scatter
        mm = partial(tree_mm, out_dtype=x.dtype, pair_experts=ids, out_rows=n, tile=SMALL_TILE)
        up = mm(x, w_up, row_div=k, weight2=w_gate, out2=gate)  # gate and up in one launch
        h, on_load = _down_rows(gate, up)
        mm(h, w_down, segments=segments, out=out, up=on_load)
        return out.view(t, k, hidden)
    tile = _sorted_tile(n, w_gate.shape[1], segments)
    order, rows, tiles = _schedule(ids, num_experts, k, tile[0])
    mm = partial(tree_mm, out_dtype=x.dtype, tiles=tiles, out_rows=n, tile=tile)
    up = mm(x, w_up, rows=rows, weight2=w_gate, out2=gate)
    # Each row is stored straight to its pair's place.
    h, on_load = _down_rows(gate, up)
    mm(h, w_down, segments=segments, dst=order, out=out, up=on_load)
    return out.view(t, k, hidden)
