"""Qwen3-MoE models: the seeded tiny checkpoint writer and the single-process reference model."""

from onpolicy.models.tiny import TinyConfig, write_tiny_checkpoint

__all__ = ["TinyConfig", "write_tiny_checkpoint"]
