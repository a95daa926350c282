"""Exact MoE (CPU): router, per-token SwiGLU experts, combine in expert-id order.

- Router: logits = linear(x, gate) in x's dtype; fp32 softmax (the tree sum over experts);
  top-k by a *stable* descending sort, so equal probabilities go to the lower expert id;
  optional renormalisation by the tree sum of the k picked probabilities.
- Experts: every (token, slot) pair runs gate/up/down through the exact `linear` and
  `silu_mul`, whose rows are independent, so grouping tokens by expert changes nothing.
- Combine (`compose.combine`, torch code every backend shares): a token's k slot outputs are
  put in ascending expert-id order and summed by the pairwise tree in fp32 as weight * output,
  then rounded once. The order depends only on which experts the token picked, never on where
  those experts live.
Expert parallelism: a rank computes the slots whose expert it owns (`expert_outputs` with
`local_experts`); each slot is filled by exactly one rank, so merging the ranks' slot tensors is
a selection (`compose.merge_expert_parallel`), not arithmetic, and the combine sees the same
bits on every layout. The block itself is `compose.moe` over these primitives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from onpolicy.kernels.compose import route_from_logits
from onpolicy.kernels.cpu.activation import silu_mul
from onpolicy.kernels.cpu.linear import linear


def route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] fp32), best first, ties to the lower id."""
    return route_from_logits(linear(x, gate_weight), top_k, renormalize)


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
