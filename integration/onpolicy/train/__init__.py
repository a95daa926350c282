"""Megatron side: model construction on the patched megatron-core, log-probs, the GRPO step."""
