"""HF Qwen3-MoE weights -> one rank's megatron-core GPTModel state dict (local layer spec).

Every Megatron tensor is built from its HF tensors as the global (unsharded) tensor first,
then sliced for this rank: TP/ETP along the dim the layer is split on, PP by contiguous layer
stages, EP by contiguous expert ranges. The slicing follows megatron-core's own CPU init
(`_initialize_affine_weight_cpu`): contiguous chunks, except fc1, whose [gate; up] halves are
chunked separately (stride 2) so that every rank holds [gate_r; up_r].
"""

from __future__ import annotations

import torch

from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import check_hf_weights
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


def _chunk(t: torch.Tensor, n: int, i: int, dim: int, what: str) -> torch.Tensor:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} does not split into {n} shards")
    return t.chunk(n, dim=dim)[i].contiguous()


def qkv_weight(cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """linear_qkv rows per KV group g: [q heads of g | k_g | v_g]."""
    groups, d, h = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    q = sd[f"{prefix}.q_proj.weight"].view(groups, -1, d, h)
    k = sd[f"{prefix}.k_proj.weight"].view(groups, 1, d, h)
    v = sd[f"{prefix}.v_proj.weight"].view(groups, 1, d, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def hf_to_megatron(
    cfg: Qwen3MoeConfig,
    sd: dict[str, torch.Tensor],
    layout: ParallelLayout,
    rank: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Global rank `rank`'s GPTModel state dict from HF config + weights, at `layout`."""
    n_layers, n_experts = cfg.num_hidden_layers, cfg.num_experts
    if n_layers % layout.pp or n_experts % layout.ep:
        raise ValueError(
            f"layout does not divide the model: {n_layers} layers over PP={layout.pp}, "
            f"{n_experts} experts over EP={layout.ep}"
        )
    if cfg.tie_word_embeddings:
        raise ValueError("HF checkpoint ties lm_head to the embedding; Qwen3-MoE does not, and "
                         "this loader maps them as separate tensors")  # fmt: skip
    check_hf_weights(cfg, sd)
    tp_rank, etp_rank, pp_rank = layout.tp_rank(rank), layout.etp_rank(rank), layout.pp_rank(rank)
    tp = lambda t, dim, what: _chunk(t, layout.tp, tp_rank, dim, what)  # noqa: E731
    etp = lambda t, dim, what: _chunk(t, layout.etp, etp_rank, dim, what)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = tp(sd["model.embed_tokens.weight"], 0, "embed")
    experts = layout.experts(rank, n_experts)
    for local, g in enumerate(layout.layers(rank, n_layers)):
        src, dst = f"model.layers.{g}", f"decoder.layers.{local}"
        attn = f"{src}.self_attn"
        out[f"{dst}.input_layernorm.weight"] = sd[f"{src}.input_layernorm.weight"]
        out[f"{dst}.self_attention.linear_qkv.weight"] = tp(qkv_weight(cfg, sd, attn), 0, "qkv")
        out[f"{dst}.self_attention.linear_proj.weight"] = tp(sd[f"{attn}.o_proj.weight"], 1, "o")
        out[f"{dst}.self_attention.q_layernorm.weight"] = sd[f"{attn}.q_norm.weight"]
        out[f"{dst}.self_attention.k_layernorm.weight"] = sd[f"{attn}.k_norm.weight"]
        out[f"{dst}.pre_mlp_layernorm.weight"] = sd[f"{src}.post_attention_layernorm.weight"]
        out[f"{dst}.mlp.router.weight"] = sd[f"{src}.mlp.gate.weight"]
        for j, expert in enumerate(experts):
            e = f"{src}.mlp.experts.{expert}"
            x = f"{dst}.mlp.experts.local_experts.{j}"
            gate = etp(sd[f"{e}.gate_proj.weight"], 0, "gate")
            up = etp(sd[f"{e}.up_proj.weight"], 0, "up")
            out[f"{x}.linear_fc1.weight"] = torch.cat([gate, up])
            out[f"{x}.linear_fc2.weight"] = etp(sd[f"{e}.down_proj.weight"], 1, "down")
    if pp_rank == layout.pp - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        out["output_layer.weight"] = tp(sd["lm_head.weight"], 0, "lm_head")
    return {k: v.to(dtype) for k, v in out.items()}
