"""SGLang's Qwen3-MoE sparse block on the exact path: router, experts and the EP/TP combine.

Every TP rank holds the same tokens. Rank r = ep_rank * moe_tp + moe_tp_rank owns experts
[ep_rank * E_local, (ep_rank + 1) * E_local) and the moe_tp_rank-th slice of their intermediate
dim (SGLang's layout). With whole experts (moe_tp = 1) a rank computes its slots' outputs by
`kernels.moe_expert_outputs` (the grouped kernel on CUDA; each slot's down projection is the
run's segment tree, rounded once), zeros elsewhere, and an all-gather over the EP ranks gives
every rank every rank's slots: step 1 below is then already done. Otherwise each rank
computes, for every (token, slot) whose expert it owns, the fp32 partial of the down
projection over its slice (zeros elsewhere). One all-gather over the TP group gives every rank
every partial; then, the same on every rank:
1. the moe_tp partials of an expert (each over S / moe_tp of the run's S segments of the
   intermediate dim, `onpolicy.segments`) are summed by the pairwise tree in rank order and
   rounded once: `kernels.linear`'s last step, so the slot output is the run's segment tree;
2. each slot is taken from the EP rank owning its expert (a selection, not a sum);
3. `kernels.moe_combine` sums a token's slots in ascending expert-id order.
The output is then complete on every rank; the patched `post_experts_output_is_complete` tells
the layer boundary that no further sum is owed.

The routed expert ids go to SGLang's routed-experts capturer, as its own TopK would send them
(`capture_routed_experts_if_allowed`, a no-op unless the engine runs with
`enable_return_routed_experts`), so a request with `return_routed_experts=True` gets the ids
this path used (`onpolicy.rollout.routing`), and to `onpolicy.rollout.capture` (a no-op unless
a `--bisect` capture is on).
"""

from __future__ import annotations

import torch

from onpolicy import collectives
from onpolicy import kernels as K
from onpolicy.rollout import capture
from onpolicy.segments import per_rank


def sparse_moe_forward(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`Qwen3MoeSparseMoeBlock.forward_normal`: [T, H] in, the combined MoE output [T, H] out."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.layers.moe.topk import capture_routed_experts_if_allowed

    experts = block.experts
    x = hidden.reshape(-1, hidden.shape[-1])
    ids, weights = K.moe_route(x, block.gate.weight, block.topk.topk_config.top_k,
                               block.topk.topk_config.renormalize)  # fmt: skip
    capture_routed_experts_if_allowed(block.topk.topk_config, block.layer_id, ids)
    capture.router(block.layer_id, ids, weights)
    ep, moe_tp = experts.moe_ep_size, experts.moe_tp_size
    n_local = experts.num_local_experts
    first = experts.moe_ep_rank * n_local
    w13, w2 = experts.w13_weight, experts.w2_weight
    inter = w13.shape[1] // 2
    segments = per_rank("experts", moe_tp)
    owner = torch.arange(ep * n_local, device=x.device) // n_local
    if moe_tp == 1:  # whole experts: the kernels' grouped expert op, each slot rounded once
        local_ids = torch.where((ids >= first) & (ids < first + n_local), ids - first, n_local)
        mine = K.moe_expert_outputs(x, local_ids, w13[:, :inter], w13[:, inter:], w2,
                                    local_experts=range(n_local), segments=segments)  # fmt: skip
        if ep > 1:
            mine = collectives.all_gather(mine[None], get_tp_group().device_group)
        slots = K.moe_merge_expert_parallel(list(mine.view(ep, *ids.shape, -1)), ids, owner)
        return K.moe_combine(slots, ids, weights).view(hidden.shape)
    partial = x.new_zeros((*ids.shape, x.shape[-1]), dtype=torch.float32)
    for e in range(n_local):
        tok, slot = torch.nonzero(ids == first + e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = K.silu_mul(K.linear(xe, w13[e, :inter]), K.linear(xe, w13[e, inter:]))
        partial[tok, slot] = K.linear_partial(h, w2[e], segments=segments)
    tp = ep * moe_tp
    if tp > 1:
        gathered = collectives.all_gather(partial[None], get_tp_group().device_group)
    else:
        gathered = partial[None]
    gathered = gathered.view(ep, moe_tp, *partial.shape)
    per_ep_rank = [K.combine_partials(list(g), x.dtype) for g in gathered]
    slots = K.moe_merge_expert_parallel(per_ep_rank, ids, owner)
    return K.moe_combine(slots, ids, weights).view(hidden.shape)
