"""Exact MoE (CUDA): the router, a grouped block-tree GEMM over all experts, the combine.

- Router: the exact linear, then `route_from_logits` (elementwise ops, tree sums, a stable
  sort), shared with the CPU backend.
- Experts: the (token, slot) pairs are sorted by expert (stably), cut into tiles of
  `linear.BLOCK_M` rows per expert, and run through `tree_mm` in grouped mode: the same
  kernel, tile shape and block tree as `linear`, reading each row of x by index. A row's bits
  are then those of `linear` on that row alone, whatever else the expert holds; gate and up
  are two grouped GEMMs, then `silu_mul`, then the grouped down projection.
- Merge and combine: the CPU backend's torch ops (a selection, and the pairwise tree in
  ascending expert-id order), exact on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.cpu.moe import combine, merge_expert_parallel, route_from_logits
from onpolicy.kernels.cuda import linear as _linear
from onpolicy.kernels.cuda.elementwise import silu_mul
from onpolicy.kernels.cuda.linear import linear, tree_mm

__all__ = ["combine", "expert_outputs", "merge_expert_parallel", "moe", "route"]


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32), best first, ties to the lower id."""
    return route_from_logits(linear(x, gate_weight), top_k, renormalize)


def _tiles(expert_of_pair: torch.Tensor, num_experts: int):
    """The grouped GEMM's schedule, built on the device without a host sync.

    Returns (order, (tile_expert, tile_start, tile_end)): `order` sorts the pairs by expert
    (pairs of experts >= num_experts go last and get no tile); tile i covers sorted rows
    [tile_start, tile_end) of expert tile_expert (-1: an unused tile, the grid's slack).
    """
    n = expert_of_pair.numel()
    order = torch.sort(expert_of_pair, stable=True).indices
    counts = torch.bincount(expert_of_pair, minlength=num_experts + 1)[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    bm = _linear.BLOCK_M
    per = (counts + bm - 1) // bm
    first = torch.cumsum(per, 0) - per
    slots = torch.arange(triton.cdiv(n, bm) + num_experts, device=counts.device)
    e = torch.searchsorted(torch.cumsum(per, 0), slots, right=True)
    ec = e.clamp(max=num_experts - 1)
    tile_start = starts[ec] + (slots - first[ec]) * bm
    tile_end = starts[ec] + counts[ec]
    tile_expert = torch.where(e < num_experts, e, -1)
    return order, (tile_expert, tile_start, tile_end)


def expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    local_experts: Sequence[int] | None = None,
) -> torch.Tensor:
    """[T, k, H] SwiGLU output of each (token, slot)'s expert, in x's dtype; slots whose expert
    is not in `local_experts` (default: all) stay zero. The gradient is a per-expert torch
    loop's."""
    return exact_with_native_grad(
        lambda *a: _expert_outputs_exact(*a, topk_ids, local_experts),
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


def _expert_outputs_exact(x, w_gate, w_up, w_down, topk_ids, local_experts):
    t, k = topk_ids.shape
    num_experts, hidden = w_gate.shape[0], w_down.shape[1]
    ids = topk_ids.reshape(-1).long()
    if local_experts is not None:
        local = torch.as_tensor(list(local_experts), dtype=torch.long, device=ids.device)
        ids = torch.where(torch.isin(ids, local), ids, num_experts)
    if ids.numel() == 0:
        return x.new_zeros(t, k, hidden)
    order, tiles = _tiles(ids, num_experts)
    rows = (order // k).to(torch.int64)
    n = ids.numel()
    gate = tree_mm(x, w_gate, out_dtype=x.dtype, rows=rows, tiles=tiles, out_rows=n)
    up = tree_mm(x, w_up, out_dtype=x.dtype, rows=rows, tiles=tiles, out_rows=n)
    down = tree_mm(silu_mul(gate, up), w_down, out_dtype=x.dtype, tiles=tiles, out_rows=n)
    # Rows of non-local pairs were never written: select, never multiply, to drop them.
    down = torch.where((ids[order] < num_experts)[:, None], down, 0.0)
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    out[order] = down
    return out.view(t, k, hidden)


def moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
) -> torch.Tensor:
    """The whole sparse MoE block on one rank: route, every expert, combine."""
    ids, weights = route(x, gate_weight, top_k, renormalize)
    return combine(expert_outputs(x, ids, w_gate, w_up, w_down), ids, weights)
