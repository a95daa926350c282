"""Build a megatron-core GPTModel for a Qwen3-MoE HF config, on the patched upstream.

The model uses the exact layer spec (`onpolicy.train.spec`, every numeric module from
`onpolicy.kernels` and `onpolicy.collectives`) or megatron-core's local (non-Transformer-Engine)
spec; both run on CPU with gloo as well as on CUDA. Parallelism is
the run's `ParallelLayout`; `initialize_parallel_state` sets megatron-core's groups from it and
checks that every rank sits where the layout says. `unwrap` finds the GPTModel under the
training wrappers. `onpolicy.train.builder` puts these together for every trainer.
"""

from __future__ import annotations

import torch

from onpolicy.layout import ParallelLayout
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


def transformer_config(
    cfg: Qwen3MoeConfig, layout: ParallelLayout, dtype: torch.dtype = torch.float32
):
    """The TransformerConfig that reproduces HF Qwen3-MoE math with the local spec."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        # Every layer is MoE (Qwen3MoeConfig refuses dense layers), so no dense MLP is built.
        ffn_hidden_size=cfg.moe_intermediate_size,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        # Top-k on logits then softmax over the k equals Qwen3's softmax-topk-renormalise.
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        attention_backend=AttnBackend.local,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        variable_seq_lengths=True,
    )


SPECS = ("exact", "local")
"""`exact`: every numeric module from onpolicy (`onpolicy.train.spec`); `local`: megatron-core's
stock local spec, the baseline the exact one is compared against."""


def build_gpt_model(
    cfg: Qwen3MoeConfig,
    layout: ParallelLayout,
    dtype: torch.dtype = torch.float32,
    spec: str = "exact",
):
    """GPTModel for this rank's pipeline stage, with the exact layer spec or the local one.

    The exact model takes packed THD batches (`onpolicy.train.logprobs.PackedBatch`): its core
    attention applies RoPE per packed segment, so GPTModel's own rotary embedding is off.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if spec not in SPECS:
        raise ValueError(f"build_gpt_model: spec {spec!r} is not one of {SPECS}")
    config = transformer_config(cfg, layout, dtype)
    if spec == "exact":
        from onpolicy.train.spec import ExactGPTModel, exact_block_spec

        model_cls = ExactGPTModel
        layer_spec = exact_block_spec(cfg, get_num_layers_to_build(config))
        rope = "none"  # applied by ExactCoreAttention
    else:
        model_cls = GPTModel
        layer_spec = get_gpt_layer_local_spec(
            num_experts=cfg.num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=True,
            normalization="RMSNorm",
        )
        rope = "rope"
    return model_cls(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type=rope,
        rotary_base=cfg.rope_theta,
    )


def initialize_parallel_state(layout: ParallelLayout) -> None:
    """megatron-core's parallel groups for `layout` (torch.distributed already initialised)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    layout.check_parallel_state()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under its wrappers (Megatron DDP, Float16Module: each holds it as `.module`);
    the model itself when unwrapped."""
    while hasattr(model, "module"):
        model = model.module
    return model
