"""The Qwen3-MoE shape: the one description of a model's dims every side uses.

The contract, the tiny-checkpoint writer, the reference model, the Megatron builder and the
HF -> Megatron loader all take a `Qwen3MoeConfig`, spelled with HF config.json's field names and
read from a checkpoint's config.json (`from_hf`) or written to one (`to_hf`).

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
    """The fields of a Qwen3-MoE config.json that every side of the stack uses."""

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

    def __post_init__(self) -> None:
        sizes = {f: getattr(self, f) for f in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "max_position_embeddings",
        )}  # fmt: skip
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen3-MoE config: {name} = {v!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3-MoE config: num_attention_heads = {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads = {self.num_key_value_heads} (GQA groups)"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3-MoE config: num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                f"num_experts = {self.num_experts}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3-MoE config: head_dim = {self.head_dim} must be even (RoPE)")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)

    def to_hf(self) -> dict:
        """The config.json fields of this shape, as the published Qwen3-MoE configs spell them;
        `from_hf(c.to_hf()) == c`."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "eos_token_id": self.eos_token_id,
        }

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike) -> Qwen3MoeConfig:
        """Parse a config.json (a dict, the file, or its folder); refuse what is not covered."""
        if not isinstance(config, dict):
            path = Path(config)
            file = path / "config.json" if path.is_dir() else path
            try:
                config = json.loads(file.read_text())
            except FileNotFoundError:
                raise ValueError(
                    f"Qwen3-MoE config: no {file.name} at {file.parent} (an HF checkpoint folder "
                    "holds config.json beside its *.safetensors)"
                ) from None
            except json.JSONDecodeError as e:
                raise ValueError(f"Qwen3-MoE config: {file} is not valid JSON: {e}") from e
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
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "num_experts",
                               "num_experts_per_tok", "moe_intermediate_size", "rms_norm_eps",
                               "max_position_embeddings") if k not in c]  # fmt: skip
        if missing:
            refuse("fields", missing, "a Qwen3-MoE config.json must name them")
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
