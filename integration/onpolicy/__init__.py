"""True-on-policy GRPO for Qwen3-MoE: every exact op, shared by the Megatron and SGLang patches."""

__version__ = "0.1.0"
