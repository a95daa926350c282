"""Exact RoPE (CPU): neox style, fp32 math, cos/sin read from one fp32 table per model.

The table is built once from (head_dim, theta, max_positions) with the same arithmetic as the
HF rotary embedding (inv_freq = 1 / theta^(2i/d), angle = position * inv_freq). Every call
reads rows of that table, so a position's cos/sin never depends on which other positions are in
the batch; the rotation itself is elementwise fp32 and is rounded once at the end.
"""

from __future__ import annotations

import torch


def rope_table(head_dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of the angles in the first half, sin in the second."""
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] at `positions` [T] (neox halves); returns x's dtype."""
    half = x.shape[-1] // 2
    if table.shape[-1] != 2 * half:
        raise ValueError(f"rope: table is for head_dim {table.shape[-1]}, x has {x.shape[-1]}")
    if positions.numel() and int(positions.max()) >= table.shape[0]:
        raise ValueError(
            f"rope: position {int(positions.max())} is past the table's {table.shape[0]} positions"
        )
    rows = table[positions][:, None, :]
    cos, sin = rows[..., :half], rows[..., half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
