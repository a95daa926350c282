"""Megatron modules whose forward is `onpolicy.kernels`, their TP sums `onpolicy.collectives`.

Each class subclasses (or stands in for) the megatron-core module the local spec uses, with the
same constructor, parameters and state-dict names, so checkpoints, DDP and the optimizers treat
it like the original. Only the forward arithmetic changes:
- `ExactColumnParallelLinear`: the SP all-gather of the input by `collectives.all_gather`, then
  `kernels.linear` on this rank's output columns. Column-parallel splits N, so a rank's outputs
  are the unsharded ones.
- `ExactRowParallelLinear`: `kernels.linear_partial` over this rank's K-shard in fp32 (its
  S / tp of the run's S segments, `onpolicy.segments`), the tree over ranks
  (`collectives.tree_all_reduce`, or `collectives.reduce_scatter` under SP), then one cast.
  Equal to the unsharded linear in S segments when `row_parallel_exact(K, tp, S)`.
- `ExactRMSNorm`: `kernels.rms_norm` (the layer norms, the q/k norms and the final norm).
- `ExactCoreAttention`: RoPE (`kernels.rope`, positions restarting at each packed segment),
  then `kernels.attention` over the packed THD segments.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from onpolicy import collectives
from onpolicy import kernels as K
from onpolicy.segments import per_rank


class ExactColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose matmul is `kernels.linear` (qkv, expert fc1, the LM head)."""

    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_):  # fmt: skip
        if sequence_parallel:  # backward: the exact reduce-scatter of the input grads
            input = collectives.all_gather(input, tp_group, dim=0)
        elif allreduce_dgrad:  # identity forward; backward all-reduces the input grads over TP
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return K.linear(input, weight, bias)


class ExactRowParallelLinear(RowParallelLinear):
    """RowParallelLinear: fp32 K-shard partial, the tree over TP ranks, one cast."""

    def partial(self, input_: torch.Tensor, segments: int) -> torch.Tensor:
        """This rank's fp32 share of input @ weight.T, its K-shard in `segments` segments (its
        share of the run's S), unrounded."""
        return K.linear_partial(input_, self.weight, segments=segments)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            raise ValueError("ExactRowParallelLinear: input_is_parallel=False is not supported")
        if self.explicit_expert_comm:
            raise ValueError(
                "ExactRowParallelLinear: an expert's fc2 is reduced by the MoE layer; call "
                "partial() from ExactSequentialMLP instead"
            )
        # The one non-expert row-parallel linear of Qwen3-MoE: the attention output projection.
        out = self.partial(input_, per_rank("attention", self.tp_group.size()))
        if self.tp_group.size() > 1:
            if self.sequence_parallel:
                out = collectives.reduce_scatter(out, self.tp_group, dim=0)
            else:
                out = collectives.tree_all_reduce(out, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = K.combine_partials([out], input_.dtype, bias)
        return out, (self.bias if self.skip_bias_add else None)


class ExactRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim by `kernels.rms_norm`; built as Megatron builds its norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"ExactRMSNorm: config.normalization is {config.normalization!r}; Qwen3-MoE "
                "uses RMSNorm"
            )
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # As WrappedTorchNorm: under SP the TP ranks see different tokens, so finalize_model_grads
        # all-reduces this grad over TP.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps)


def segment_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] position of every packed token inside its own segment (each starts at 0)."""
    cu = [int(c) for c in cu_seqlens]
    return torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])


class ExactCoreAttention(MegatronModule):
    """Core attention over packed THD segments: RoPE, then causal GQA `kernels.attention`.

    RoPE lives here rather than in megatron-core's `apply_rotary_pos_emb` (bound by name in
    attention.py, no spec seam): the model is built with position_embedding_type="none", so
    Attention hands over q and k after the q/k norms, un-rotated, which is where Qwen3 rotates.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, *, rope_theta: float, max_positions: int,
                 softmax_scale: float | None = None, **_) -> None:  # fmt: skip
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ExactCoreAttention: mask {attn_mask_type} is not causal")
        if config.context_parallel_size != 1 or config.apply_query_key_layer_scaling:
            raise ValueError(
                "ExactCoreAttention: context parallel and query-key layer scaling change the "
                "attention sum; the contract pins cp = 1 and Qwen3 does not scale by layer"
            )
        self.softmax_scale = softmax_scale
        # A plain attribute, not a buffer: a bf16 cast of the module must not round the table.
        self.rope = K.rope_table(config.kv_channels, rope_theta, max_positions)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:  # fmt: skip
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "ExactCoreAttention runs packed sequences: pass packed_seq_params with "
                "qkv_format='thd' (onpolicy.train.logprobs.PackedBatch builds them)"
            )
        cu = packed_seq_params.cu_seqlens_q
        if not torch.equal(cu, packed_seq_params.cu_seqlens_kv):
            raise ValueError("ExactCoreAttention: cu_seqlens_q and cu_seqlens_kv differ")
        if self.rope.device != query.device:
            self.rope = self.rope.to(query.device)
        pos = segment_positions(cu.cpu()).to(query.device)
        q = K.rope(query, pos, self.rope)
        k = K.rope(key, pos, self.rope)
        out = K.attention(q, k, value, cu.cpu(), self.softmax_scale)
        return out.reshape(out.shape[0], -1)
