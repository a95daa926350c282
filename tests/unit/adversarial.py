"""Inputs on which a different reduction order shows, shared by the kernel property tests."""

from __future__ import annotations

import torch
from hypothesis import settings

DTYPES = [torch.bfloat16, torch.float32]
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
"""Hypothesis settings for every property: reproducible in CI, no per-example deadline."""


def wide(*shape: int, seed: int, dtype=torch.float32, spread: int = 12) -> torch.Tensor:
    """Normal mantissas times 2^e, e uniform in [-spread, spread): reordering a sum shows."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread, shape, generator=g).float()
    return (torch.randn(*shape, generator=g) * torch.exp2(e)).to(dtype)
