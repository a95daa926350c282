"""The CPU backend: pure torch, every reduction spelled out in the fixed tree order."""
