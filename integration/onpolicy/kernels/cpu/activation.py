"""Exact SiLU-and-multiply and embedding (CPU).

silu_mul computes silu(g) = g / (1 + exp(-g)) from `torch.exp` and IEEE divide, in fp32, then
multiplies by `up` and rounds once. It avoids `F.silu`/`torch.sigmoid`: on SIMD CPUs their fp32
kernels compute a tensor's tail elements with a scalar formula that differs from the vector one
in the last bit, so the same value gives different bits at different offsets. `torch.exp`
handles tails with the vector formula (a masked load), so every element gets the same bits.
"""

from __future__ import annotations

import torch

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.compose import silu_mul_native


def _silu_mul_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to gate's dtype; the gradient is F.silu's."""
    return exact_with_native_grad(_silu_mul_exact, silu_mul_native, gate, up)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of `weight` [V, H] at `ids`: a gather, exact by nature."""
    return weight[ids]
