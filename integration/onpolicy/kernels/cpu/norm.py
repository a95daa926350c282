"""Exact RMSNorm (CPU): fp32 math one row at a time, the mean square summed by the block tree.

Steps for a row x of width H (the same for the q/k norms, where the row is one head):
1. with a residual, x <- x + residual in x's dtype; that sum is also the new residual;
2. ms = tree_sum(x_fp32 ** 2, block=K_BLOCK) / H;
3. y = (x_fp32 * (1 / sqrt(ms + eps))).to(dtype), cast *before* the weight multiply;
4. out = weight * y, rounded to x's dtype.
sqrt and division are correctly rounded IEEE ops, so no step depends on the row's neighbours.
Normalising the rounded sum makes the fused form equal `rms_norm(x + residual, ...)` exactly.
"""

from __future__ import annotations

import torch

from onpolicy.kernels.rules import K_BLOCK
from onpolicy.kernels.tree import tree_sum


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual)."""
    dtype = x.dtype
    if residual is not None:
        x = (x.float() + residual.float()).to(dtype)
    xf = x.float()
    ms = tree_sum(xf * xf, dim=-1, block=K_BLOCK) / x.shape[-1]
    y = (xf * (1.0 / torch.sqrt(ms + eps))[..., None]).to(dtype)
    out = (weight.float() * y.float()).to(dtype)
    return out if residual is None else (out, x)
