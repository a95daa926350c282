"""Checkpoint conversion between the HF layout and Megatron, per parallel layout."""
