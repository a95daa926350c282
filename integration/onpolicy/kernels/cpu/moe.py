"""Exact MoE (CPU): router, per-token SwiGLU experts, combine in expert-id order.

- Router: logits = linear(x, gate) in x's dtype; fp32 softmax (the tree sum over experts);
  top-k by a *stable* descending sort, so equal probabilities go to the lower expert id;
  optional renormalisation by the tree sum of the k picked probabilities.
- Experts: every (token, slot) pair runs gate/up/down through the exact `linear` and
  `silu_mul`, whose rows are independent, so grouping tokens by expert changes nothing.
- Combine: a token's k slot outputs are put in ascending expert-id order and summed by the
  pairwise tree in fp32 as weight * output, then rounded once. The order depends only on
  which experts the token picked, never on where those experts live.
Expert parallelism: a rank computes the slots whose expert it owns (`expert_outputs` with
`local_experts`); each slot is filled by exactly one rank, so merging the ranks' slot tensors is
a selection, not arithmetic, and the combine sees the same bits on every layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from onpolicy.kernels.cpu.activation import silu_mul
from onpolicy.kernels.cpu.linear import linear
from onpolicy.kernels.tree import pairwise_tree_sum, tree_sum


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32), best first, ties to the lower id."""
    return route_from_logits(linear(x, gate_weight), top_k, renormalize)


def route_from_logits(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its linear: elementwise ops, tree sums and a stable sort, exact on any
    device."""
    logits = logits.float()
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True).detach())
    probs = e / tree_sum(e, dim=-1)[..., None]
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = probs.gather(-1, order)
    if renormalize:
        weights = weights / tree_sum(weights, dim=-1)[..., None]
    return order, weights


def expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    local_experts: Sequence[int] | None = None,
    segments: int = 1,
) -> torch.Tensor:
    """[T, k, H] SwiGLU output of each (token, slot)'s expert, in x's dtype.

    w_gate, w_up [E, I, H] and w_down [E, H, I] are indexed by global expert id. Slots whose
    expert is not in `local_experts` (default: all) stay zero. The down projection's K = I is
    cut into `segments` segments (`rules.k_segments`).
    """
    t, k = topk_ids.shape
    out = x.new_zeros(t, k, w_down.shape[1])
    experts = range(w_gate.shape[0]) if local_experts is None else local_experts
    for e in experts:
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = silu_mul(linear(xe, w_gate[e]), linear(xe, w_up[e]))
        out = out.index_put((tok, slot), linear(h, w_down[e], None, segments))
    return out


def merge_expert_parallel(per_rank: Sequence[torch.Tensor], topk_ids: torch.Tensor,
                          owner: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Take each slot from the rank that owns its expert (`owner[e]` = rank of expert e)."""
    stacked = torch.stack(list(per_rank))  # [R, T, k, H]
    pick = owner[topk_ids][None, ..., None].expand(1, *stacked.shape[1:])
    return stacked.gather(0, pick)[0]


def combine(
    outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """sum_slots weight * output in ascending expert-id order, fp32 tree, rounded to outputs'
    dtype. outputs [T, k, H], topk_ids / topk_weights [T, k]."""
    order = torch.sort(topk_ids, dim=-1, stable=True).indices
    y = outputs.gather(1, order[..., None].expand_as(outputs)).float()
    w = topk_weights.gather(1, order).float()
    return pairwise_tree_sum((w[..., None] * y).transpose(0, 1)).to(outputs.dtype)


def moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    segments: int = 1,
) -> torch.Tensor:
    """The whole sparse MoE block on one rank: route, run every expert, combine."""
    ids, weights = route(x, gate_weight, top_k, renormalize)
    return combine(expert_outputs(x, ids, w_gate, w_up, w_down, None, segments), ids, weights)
