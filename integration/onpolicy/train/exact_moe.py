"""The Megatron MoE layer on the exact ops: route, dispatch, experts, combine.

Subclasses of megatron-core's TopKRouter, SequentialMLP and MoELayer (same parameters and
state-dict names), so that the spec swaps them in. The composition is the reference model's:
- route: `kernels.moe_route` (the router linear, fp32 softmax, stable top-k with ties to the
  lower expert id, renormalisation by the tree sum of the k weights);
- dispatch: `collectives.ep_dispatch`, every (token, slot) row to the EP rank owning its expert,
  in an order that depends only on the expert ids and token positions;
- experts: per received row, fc1 (`kernels.linear`), `kernels.silu_mul`, fc2's fp32 partial
  (`kernels.linear_partial`, S / etp of the run's S segments of its K, `onpolicy.segments`);
  under ETP the rows are all-gathered over the expert-TP group and the fc2 partials
  reduce-scattered back by the tree (`collectives`), then cast once;
- combine: `collectives.ep_combine`, the rows back to their tokens and `kernels.moe_combine`,
  the k weighted outputs summed in ascending expert-id order by the fp32 tree.
No step depends on which rank holds which expert or which tokens share the batch.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from onpolicy import collectives
from onpolicy import kernels as K
from onpolicy.segments import per_rank
from onpolicy.train.exact_layers import ExactColumnParallelLinear, ExactRowParallelLinear


class ExactRouter(TopKRouter):
    """TopKRouter whose forward is `kernels.moe_route`: (topk_ids [T, k], fp32 weights [T, k])."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        unsupported = {
            "moe_router_score_function": (config.moe_router_score_function, "softmax"),
            "moe_router_topk_scaling_factor": (config.moe_router_topk_scaling_factor, None),
            "moe_router_num_groups": (config.moe_router_num_groups, None),
            "moe_router_enable_expert_bias": (config.moe_router_enable_expert_bias, False),
            "moe_expert_capacity_factor": (config.moe_expert_capacity_factor, None),
            "moe_input_jitter_eps": (config.moe_input_jitter_eps, None),
        }
        for name, (got, want) in unsupported.items():
            if got != want:
                raise ValueError(
                    f"ExactRouter: config.{name} = {got!r}; Qwen3-MoE routing (softmax, top-k, "
                    f"renormalise) needs {want!r}"
                )
        # Megatron's "pre-softmax" is softmax over all experts without renormalisation:
        # Qwen3's norm_topk_prob = False. Otherwise the k weights are renormalised.
        self.renormalize = not config.moe_router_pre_softmax

    def forward(self, input: torch.Tensor, padding_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        return K.moe_route(input, self.weight, self.topk, self.renormalize)


class ExactSequentialMLP(SequentialMLP):
    """The rank's local experts on dispatched rows: (rows [R, H], local expert index [R]) ->
    expert outputs [R, H] in the rows' dtype."""

    def __init__(self, num_local_experts: int, config, submodules, **kwargs) -> None:
        super().__init__(num_local_experts, config, submodules, **kwargs)
        for e in self.local_experts:
            if not (isinstance(e.linear_fc1, ExactColumnParallelLinear)
                    and isinstance(e.linear_fc2, ExactRowParallelLinear)):  # fmt: skip
                raise TypeError("ExactSequentialMLP needs the exact fc1/fc2 linears in its spec")
            if not e.config.gated_linear_unit:
                raise ValueError("ExactSequentialMLP: Qwen3 experts are SwiGLU (gated)")

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        etp = self.tp_group.size()
        if etp > 1:  # every expert-TP rank computes its K-shard of fc2 for all their rows
            n = torch.tensor([rows.shape[0]], device=rows.device)
            counts = [int(c) for c in collectives.all_gather(n, self.tp_group)]
            rows = collectives.all_gather(rows, self.tp_group, split_sizes=counts)
            local_ids = collectives.all_gather(local_ids, self.tp_group, split_sizes=counts)
        partial = rows.new_zeros((rows.shape[0], self.config.hidden_size), dtype=torch.float32)
        segments = per_rank("experts", etp)
        for i, expert in enumerate(self.local_experts):
            sel = torch.nonzero(local_ids == i).squeeze(1)
            fc1, _ = expert.linear_fc1(rows[sel])
            gate, up = torch.chunk(fc1, 2, dim=-1)  # fc1 is [gate; up] (per ETP rank)
            down = expert.linear_fc2.partial(K.silu_mul(gate, up), segments)
            partial = partial.index_put((sel,), down)
        if etp > 1:
            partial = collectives.reduce_scatter(partial, self.tp_group, dim=0, split_sizes=counts)
        return K.combine_partials([partial], rows.dtype)


class ExactMoELayer(MoELayer):
    """MoELayer: route, `ep_dispatch`, the local experts, `ep_combine` (see the module doc)."""

    def __init__(self, config, submodules=None, **kwargs) -> None:
        super().__init__(config, submodules, **kwargs)
        if not isinstance(self.router, ExactRouter) or not isinstance(
            self.experts, ExactSequentialMLP
        ):
            raise TypeError("ExactMoELayer needs ExactRouter and ExactSequentialMLP in its spec")
        if self.use_shared_expert:
            raise ValueError("ExactMoELayer: Qwen3-MoE has no shared experts")

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("ExactMoELayer: partial (CUDA-graph) execution is not supported")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids, weights = self.router(x)
        rows, route = collectives.ep_dispatch(x, ids, self.config.num_moe_experts, self.ep_group)
        out = self.experts(rows, route.expert_ids - self.local_expert_indices[0])
        return collectives.ep_combine(out, weights, route, self.ep_group).view(shape), None
