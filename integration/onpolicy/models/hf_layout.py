"""The HF hub layout of a Qwen3-MoE checkpoint: tensor names and shapes, reading, checking.

One description serves every side that touches HF weights: the tiny-checkpoint writer draws
exactly these tensors, and the reference model and the Megatron loader read and check them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


def hf_tensor_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, in a fixed order (the writer's draw order).

    The LM head is absent when the config ties it to the embedding.
    """
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    i, v = cfg.moe_intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (e, h),
        }
        for x in range(e):
            shapes |= {
                f"{p}.mlp.experts.{x}.gate_proj.weight": (i, h),
                f"{p}.mlp.experts.{x}.up_proj.weight": (i, h),
                f"{p}.mlp.experts.{x}.down_proj.weight": (h, i),
            }
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in an HF checkpoint folder.

    Each file's header is checked before its data is read, and a tensor stored in two files is
    refused (`onpolicy.checkpoint.hf.CheckpointError`); `read_hf_checkpoint` checks the rest.
    """
    from onpolicy.checkpoint.hf import CheckpointError, read_safetensors

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}
    for f in files:
        for name, t in read_safetensors(f).items():
            if name in seen:
                raise CheckpointError("hf_index", f, f"is also stored in {seen[name].name}", name)
            seen[name] = f
            sd[name] = t
    return sd


def check_hf_weights(cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor]) -> None:
    """Refuse weights that do not match the config, naming the tensors, before any use."""
    want = hf_tensor_shapes(cfg)
    missing = [k for k in want if k not in sd]
    wrong = [f"{k} {tuple(sd[k].shape)} (config wants {s})"
             for k, s in want.items() if k in sd and tuple(sd[k].shape) != s]  # fmt: skip
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing, e.g. {', '.join(missing[:3])}")
        if wrong:
            parts.append(f"{len(wrong)} with the wrong shape, e.g. {'; '.join(wrong[:3])}")
        raise ValueError(
            "HF checkpoint does not match its config.json (a Qwen3-MoE with "
            f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts, hidden "
            f"{cfg.hidden_size}): tensors {' and '.join(parts)}"
        )
