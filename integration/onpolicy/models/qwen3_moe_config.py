"""The Qwen3-MoE shape the reference model runs, read from an HF config.json.

Only what the exact kernels cover is accepted: every layer sparse, no attention bias, no
sliding window, plain (unscaled) RoPE. Anything else is refused with the field that failed,
rather than silently computing a different model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(kw_only=True, slots=True, frozen=True)
class Qwen3MoeConfig:
    """The fields of a Qwen3-MoE config.json the reference forward uses."""

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Residual stream width."""
    num_hidden_layers: int
    """Decoder layers, all of them MoE."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    """Width of one attention head."""
    num_experts: int
    """Routed experts per layer."""
    num_experts_per_tok: int
    """Top-k experts per token."""
    moe_intermediate_size: int
    """Hidden width of one expert's SwiGLU."""
    norm_topk_prob: bool
    """Renormalise the picked router probabilities to sum to one."""
    rope_theta: float
    """RoPE base."""
    rms_norm_eps: float
    """RMSNorm epsilon (all norms, including q/k norms)."""
    max_position_embeddings: int
    """Positions the RoPE table covers."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""
    torch_dtype: str = "bfloat16"
    """Dtype the checkpoint stores its weights in."""
    eos_token_id: int | None = None
    """End-of-sequence token, if the config names one."""

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike) -> Qwen3MoeConfig:
        """Parse a config.json (a dict, the file, or its folder); refuse what is not covered."""
        if not isinstance(config, dict):
            path = Path(config)
            config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        c = config

        def refuse(field: str, value: object, why: str) -> None:
            raise ValueError(
                f"Qwen3-MoE reference: config {field} = {value!r} is not supported: {why}"
            )

        if c.get("model_type") != "qwen3_moe":
            refuse("model_type", c.get("model_type"), "only qwen3_moe")
        if c.get("mlp_only_layers"):
            refuse("mlp_only_layers", c["mlp_only_layers"], "every layer must be MoE")
        if c.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", c["decoder_sparse_step"], "every layer must be MoE")
        if c.get("attention_bias", False):
            refuse("attention_bias", True, "Qwen3 attention has no bias")
        if c.get("use_sliding_window", False):
            refuse("use_sliding_window", True, "full causal attention only")
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling")
        rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or "default"
        if rope_type != "default":
            refuse("rope type", rope_type, "plain RoPE only")
        eos = c.get("eos_token_id")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            num_experts=c["num_experts"],
            num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["moe_intermediate_size"],
            norm_topk_prob=c.get("norm_topk_prob", False),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rms_norm_eps=c["rms_norm_eps"],
            max_position_embeddings=c["max_position_embeddings"],
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            torch_dtype=c.get("torch_dtype") or c.get("dtype") or "bfloat16",
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


QWEN3_30B_A3B = Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, eos_token_id=151645,
)  # fmt: skip
"""Qwen3-30B-A3B's published shape (config.json of the hub release), for full-size runs."""
