"""HF Qwen3-MoE weights -> one rank's megatron-core GPTModel state dict (local layer spec).

Every Megatron tensor is built from its HF tensors as the global (unsharded) tensor first,
then sliced for this rank: TP/ETP along the dim the layer is split on, PP by contiguous layer
stages, EP by contiguous expert ranges. The slicing follows megatron-core's own CPU init
(`_initialize_affine_weight_cpu`): contiguous chunks, except fc1, whose [gate; up] halves are
chunked separately (stride 2) so that every rank holds [gate_r; up_r].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onpolicy.models.hf_layout import check_hf_weights
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


@dataclass(kw_only=True, slots=True, frozen=True)
class RankCoords:
    """Where one rank sits in the Megatron grid."""

    tp: int = 1
    """Tensor-parallel size."""
    tp_rank: int = 0
    """This rank's TP index."""
    pp: int = 1
    """Pipeline-parallel size."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    ep: int = 1
    """Expert-parallel size."""
    ep_rank: int = 0
    """This rank's EP index."""
    etp: int = 1
    """Expert tensor-parallel size."""
    etp_rank: int = 0
    """This rank's expert-TP index."""

    @classmethod
    def from_parallel_state(cls) -> RankCoords:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )


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
    cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor], rank: RankCoords, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """This rank's GPTModel state dict from HF config + weights."""
    n_layers, n_experts = cfg.num_hidden_layers, cfg.num_experts
    if n_layers % rank.pp or n_experts % rank.ep:
        raise ValueError(
            f"layout does not divide the model: {n_layers} layers over PP={rank.pp}, "
            f"{n_experts} experts over EP={rank.ep}"
        )
    if cfg.tie_word_embeddings:
        raise ValueError("HF checkpoint ties lm_head to the embedding; Qwen3-MoE does not, and "
                         "this loader maps them as separate tensors")  # fmt: skip
    per_stage, per_ep = n_layers // rank.pp, n_experts // rank.ep
    check_hf_weights(cfg, sd)
    tp = lambda t, dim, what: _chunk(t, rank.tp, rank.tp_rank, dim, what)  # noqa: E731
    etp = lambda t, dim, what: _chunk(t, rank.etp, rank.etp_rank, dim, what)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if rank.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = tp(sd["model.embed_tokens.weight"], 0, "embed")
    for local in range(per_stage):
        g = rank.pp_rank * per_stage + local
        src, dst = f"model.layers.{g}", f"decoder.layers.{local}"
        attn = f"{src}.self_attn"
        out[f"{dst}.input_layernorm.weight"] = sd[f"{src}.input_layernorm.weight"]
        out[f"{dst}.self_attention.linear_qkv.weight"] = tp(qkv_weight(cfg, sd, attn), 0, "qkv")
        out[f"{dst}.self_attention.linear_proj.weight"] = tp(sd[f"{attn}.o_proj.weight"], 1, "o")
        out[f"{dst}.self_attention.q_layernorm.weight"] = sd[f"{attn}.q_norm.weight"]
        out[f"{dst}.self_attention.k_layernorm.weight"] = sd[f"{attn}.k_norm.weight"]
        out[f"{dst}.pre_mlp_layernorm.weight"] = sd[f"{src}.post_attention_layernorm.weight"]
        out[f"{dst}.mlp.router.weight"] = sd[f"{src}.mlp.gate.weight"]
        for j in range(per_ep):
            e = f"{src}.mlp.experts.{rank.ep_rank * per_ep + j}"
            x = f"{dst}.mlp.experts.local_experts.{j}"
            gate = etp(sd[f"{e}.gate_proj.weight"], 0, "gate")
            up = etp(sd[f"{e}.up_proj.weight"], 0, "up")
            out[f"{x}.linear_fc1.weight"] = torch.cat([gate, up])
            out[f"{x}.linear_fc2.weight"] = etp(sd[f"{e}.down_proj.weight"], 1, "down")
    if rank.pp_rank == rank.pp - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        out["output_layer.weight"] = tp(sd["lm_head.weight"], 0, "lm_head")
    return {k: v.to(dtype) for k, v in out.items()}
