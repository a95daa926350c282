"""Qwen3-MoE models: the one shape type, the seeded tiny checkpoint writer, the reference model."""

from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B, Qwen3MoeConfig
from onpolicy.models.tiny import TINY, tiny, write_tiny_checkpoint

__all__ = ["QWEN3_30B_A3B", "TINY", "Qwen3MoeConfig", "tiny", "write_tiny_checkpoint"]
