"""Inputs on which a different reduction order shows, shared by the kernel property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from onpolicy.bits import assert_bitwise, bitwise_equal, mismatch_report, n_differ  # noqa: F401

DTYPES = [torch.bfloat16, torch.float32]
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
"""Hypothesis settings for every property: reproducible in CI, no per-example deadline."""

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""cuda is marked gpu: run with -m gpu on the GPU machine; tests/conftest.py skips it elsewhere."""
CUDA = DEVICES[1:]
"""The cuda case alone: for negative controls about what the plain CUDA op does."""


def wide(
    *shape: int, seed: int, dtype=torch.float32, spread: int = 12, device: str = "cpu"
) -> torch.Tensor:
    """Normal mantissas times 2^e, e uniform in [-spread, spread): reordering a sum shows.
    Drawn on the CPU, then moved, so every device gets the same values."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread, shape, generator=g).float()
    return (torch.randn(*shape, generator=g) * torch.exp2(e)).to(dtype).to(device)
