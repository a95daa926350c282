"""The exact Qwen3-MoE layer spec for megatron-core: every numeric module from onpolicy.

`OnpolicySpecProvider` implements megatron-core's `BackendSpecProvider` protocol
(models/backends.py), as `LocalSpecProvider` and `InferenceSpecProvider` do, with the modules
of `exact_layers` and `exact_moe`. `exact_block_spec` composes them into the decoder the local
spec builds (same module tree and state-dict names), plus the two MoE pieces that protocol does
not name: the router and the MoE layer.

- RMSNorm (input, pre-MLP, q, k, final): `ExactRMSNorm`, `kernels.rms_norm`;
- qkv, expert fc1, LM head: `ExactColumnParallelLinear`, `kernels.linear` (the SP all-gather
  by `collectives.all_gather`);
- attention output: `ExactRowParallelLinear`, `kernels.linear_partial` (the run's K segments,
  `onpolicy.segments`), the tree all-reduce or reduce-scatter over TP (`collectives`), one cast;
- RoPE and core attention over packed THD: `ExactCoreAttention`, `kernels.rope`,
  `kernels.attention`;
- router: `ExactRouter`, `kernels.moe_route`;
- SwiGLU experts and expert TP: `ExactSequentialMLP`, `kernels.silu_mul`, `collectives`;
- EP dispatch and combine: `ExactMoELayer`, `collectives.ep_dispatch` / `ep_combine`
  (`kernels.moe_combine`);
- LM head: `ExactGPTModel` rebuilds it as `ExactColumnParallelLinear`.
"""

from __future__ import annotations

from functools import partial

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.exact_layers import (
    ExactColumnParallelLinear,
    ExactCoreAttention,
    ExactRMSNorm,
    ExactRowParallelLinear,
)
from onpolicy.train.exact_moe import ExactMoELayer, ExactRouter, ExactSequentialMLP


class OnpolicySpecProvider(BackendSpecProvider):
    """megatron-core's backend protocol, answered with the exact modules."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        self.cfg = cfg

    def column_parallel_linear(self) -> type:
        return ExactColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return ExactRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> None:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False,
                   has_residual: bool = False) -> type:  # fmt: skip
        if not rms_norm:
            raise ValueError("OnpolicySpecProvider: Qwen3-MoE normalises by RMSNorm only")
        return ExactRMSNorm

    def core_attention(self):
        return partial(ExactCoreAttention, rope_theta=self.cfg.rope_theta,
                       max_positions=self.cfg.max_position_embeddings)  # fmt: skip

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if moe_use_grouped_gemm:
            raise ValueError("OnpolicySpecProvider: the exact experts are sequential, not grouped")
        fc = MLPSubmodules(linear_fc1=self.column_parallel_linear(),
                           linear_fc2=self.row_parallel_linear())  # fmt: skip
        return partial(ExactSequentialMLP, submodules=fc)

    def activation_func(self) -> None:
        return None  # SwiGLU runs inside ExactSequentialMLP (kernels.silu_mul)


def exact_layer_spec(cfg: Qwen3MoeConfig) -> ModuleSpec:
    """One Qwen3-MoE decoder layer: the local spec's tree with every module exact."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules

    p = OnpolicySpecProvider(cfg)
    norm = p.layer_norm(rms_norm=True)
    moe = partial(ExactMoELayer, submodules=MoESubmodules(
        experts=p.grouped_mlp_modules(False), router=ExactRouter))  # fmt: skip
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=p.column_parallel_linear(), core_attention=p.core_attention(),
            linear_proj=p.row_parallel_linear(), q_layernorm=norm, k_layernorm=norm,
        ),
    )  # fmt: skip
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add,
            # The local spec's checkpoint names, so dist-checkpoints interchange with it.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )  # fmt: skip


def exact_block_spec(cfg: Qwen3MoeConfig, layers_on_stage: int) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder: `layers_on_stage` exact layers and the exact final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[exact_layer_spec(cfg)] * layers_on_stage, layer_norm=ExactRMSNorm
    )


class ExactGPTModel(GPTModel):
    """GPTModel with the LM head as `ExactColumnParallelLinear`.

    GPTModel hard-codes its output layer class, so it is rebuilt with the same arguments (same
    parameter and state-dict names) once GPTModel has built the rest.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.post_process:
            old = self.output_layer
            self.output_layer = ExactColumnParallelLinear(
                self.config.hidden_size, self.vocab_size, config=self.config,
                init_method=self.config.init_method, bias=False, skip_bias_add=False,
                gather_output=old.gather_output, skip_weight_param_allocation=old.weight is None,
                embedding_activation_buffer=self.embedding_activation_buffer,
                grad_output_buffer=self.grad_output_buffer, tp_group=self.pg_collection.tp,
            )  # fmt: skip
            self.setup_embeddings_and_output_layer()
