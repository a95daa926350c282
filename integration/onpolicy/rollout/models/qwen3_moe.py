"""Qwen3-MoE: SGLang's own model class (patched by the series), registered under its name."""

from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

EntryClass = Qwen3MoeForCausalLM
