"""Exact RMSNorm, RoPE, SiLU-and-multiply and embedding (CUDA).

Each is one program per row (or per block of elements) with a configuration fixed by the row
width alone, so a row's bits never depend on how many rows there are or where it sits:
- rms_norm: the mean square is one `tl.sum` over the row in a layout fixed by the width; then
  the CPU backend's steps (fused residual add rounded first, normalise in fp32, cast, weight);
- rope: neox halves rotated in fp32 with cos/sin read from the model's fp32 table, rounded once;
- silu_mul: g / (1 + exp(-g)) * up in fp32, rounded once; elementwise, so offsets cannot matter;
- embedding: a row copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.compose import silu_mul_native
from onpolicy.kernels.cpu import norm as _torch_norm
from onpolicy.kernels.cpu import rope as _torch_rope


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _width_config(width: int) -> tuple[int, int]:
    """(block, warps) for a row of `width`: a function of the width only."""
    block = triton.next_power_of_2(max(width, 16))
    return block, max(1, min(8, block // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * H + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * H + cols, x, mask=ok)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, 0) / H
    y = (xf * (1.0 / tl.sqrt_rn(ms + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual). The gradient
    is that of the same steps in plain torch (the CPU backend's ops, run on this device)."""
    if residual is None:
        return exact_with_native_grad(
            lambda x_, w_: _rms_norm_exact(x_, w_, eps, None),
            lambda x_, w_: _torch_norm.rms_norm(x_, w_, eps),
            x, weight,
        )  # fmt: skip
    return exact_with_native_grad(
        lambda x_, w_, r_: _rms_norm_exact(x_, w_, eps, r_),
        lambda x_, w_, r_: _torch_norm.rms_norm(x_, w_, eps, r_),
        x, weight, residual,
    )  # fmt: skip


def _rms_norm_exact(x, weight, eps, residual):
    h = x.shape[-1]
    if weight.shape[-1] != h:
        raise ValueError(f"rms_norm: weight has {weight.shape[-1]} elements, rows have {h}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    res_out = torch.empty_like(xc) if residual is not None else out
    res = residual.contiguous() if residual is not None else xc
    rows = xc.numel() // max(h, 1)
    if rows:
        block, warps = _width_config(h)
        _rms_norm_kernel[(rows,)](
            xc, res, weight.contiguous(), out, res_out, h, eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return out if residual is None else (out, res_out)


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, table_ptr, out_ptr, heads, stride_xt, stride_xh, stride_table,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    hh = tl.arange(0, HEADS)
    ok = (hh < heads)[:, None]
    cos = tl.load(table_ptr + pos * stride_table + i)[None, :]
    sin = tl.load(table_ptr + pos * stride_table + HALF + i)[None, :]
    at = t * stride_xt + hh[:, None] * stride_xh + i[None, :]
    x1 = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + at + HALF, mask=ok, other=0.0).to(tl.float32)
    o = t * heads * 2 * HALF + hh[:, None] * 2 * HALF + i[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + o, (x1 * cos - x2 * sin).to(dt), mask=ok)
    tl.store(out_ptr + o + HALF, (x2 * cos + x1 * sin).to(dt), mask=ok)


def rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] at `positions` [T] (neox halves); returns x's dtype. The
    gradient is the plain torch rotation's."""
    return exact_with_native_grad(
        lambda x_: _rope_exact(x_, positions, table),
        lambda x_: _torch_rope.rope(x_, positions.to(x_.device), table.to(x_.device)),
        x,
    )


def _rope_exact(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    t, heads, d = x.shape
    half = d // 2
    if table.shape[-1] != 2 * half:
        raise ValueError(f"rope: table is for head_dim {table.shape[-1]}, x has {d}")
    if half & (half - 1):
        raise ValueError(f"rope: head_dim {d} must be twice a power of 2 on CUDA")
    if positions.numel() and _capturing():  # no host read while a CUDA graph is captured
        torch._assert_async(positions.max() < table.shape[0], "rope: position past the table")
    elif positions.numel() and int(positions.max()) >= table.shape[0]:
        raise ValueError(
            f"rope: position {int(positions.max())} is past the table's {table.shape[0]} positions"
        )
    table = table.to(x.device, torch.float32).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](x, positions.to(x.device).contiguous(), table, out, heads,
                           x.stride(0), x.stride(1), table.stride(0), HALF=half,
                           HEADS=triton.next_power_of_2(heads))  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n"])  # n grows with the batch (warmup.py)
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


def _silu_mul_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    if g.numel():
        _silu_mul_kernel[(triton.cdiv(g.numel(), 1024),)](g, u, out, g.numel(), BLOCK=1024)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to gate's dtype; the gradient is F.silu's."""
    return exact_with_native_grad(_silu_mul_exact, silu_mul_native, gate, up)


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, H, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + t).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    tl.store(out_ptr + t * H + cols, tl.load(w_ptr + row * H + cols, mask=ok), mask=ok)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of `weight` [V, H] at `ids`; out-of-range ids are refused, naming the first."""
    v, h = weight.shape
    flat = ids.reshape(-1).to(weight.device)
    outside = (flat < 0) | (flat >= v)
    # A gather past the table would read other memory silently. While a CUDA graph is captured
    # the host cannot read the ids: the check becomes a device-side assert.
    if _capturing():
        torch._assert_async(~outside.any(), "embedding: a token id is outside the vocab")
    elif bool(outside.any()):
        raise IndexError(f"embedding: token id {int(flat[outside][0])} is outside the vocab of {v}")
    out = torch.empty(flat.numel(), h, dtype=weight.dtype, device=weight.device)
    if flat.numel():
        _embedding_kernel[(flat.numel(), triton.cdiv(h, 1024))](
            flat.contiguous(), weight.contiguous(), out, h, BLOCK=1024
        )
    return out.view(*ids.shape, h)
