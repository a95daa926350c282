"""Exact RMSNorm, RoPE, SiLU-and-multiply and embedding (CUDA).

Each is one program per row (or per block of elements) with a configuration fixed by the row
width alone, so a row's bits never depend on how many rows there are or where it sits:
- rms_norm: the mean square is one `tl.sum` over the row in a layout fixed by the width; then
  the CPU backend's steps (fused residual add rounded first, normalise in fp32, cast, weight);
- rope: neox halves rotated in fp32 with cos/sin read from the model's fp32 table, rounded once;
- qk_norm_rope: rms_norm then rope of each head of q and k in one launch, one program per
  (token, head): `rms_norm`'s body (the same jit helpers, layout and order) stores the
  normed row, then `rope`'s rotation of its halves loaded back; the bits of the two ops;
- silu_mul: g / (1 + exp(-g)) * up in fp32, rounded once; elementwise, so offsets cannot matter;
- embedding: a row copy;
- kv_store: the new keys' and values' rows copied into a paged cache, both in one launch.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.compose import check_kv_store, silu_mul_native
from onpolicy.kernels.cpu import norm as _torch_norm
from onpolicy.kernels.cpu import rope as _torch_rope
from onpolicy.kernels.rules import cdiv, next_power_of_2


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _width_config(width: int) -> tuple[int, int]:
    """(block, warps) for a row of `width`: a function of the width only."""
    block = next_power_of_2(max(width, 16))
    return block, max(1, min(8, block // 256))


@triton.jit
def _inv_rms(x, H, eps):
    """1 / sqrt(mean(x^2) + eps) of one row x (loaded, its padding 0): one `tl.sum` in x's
    layout, which the row's width fixes (`_width_config`)."""
    xf = x.to(tl.float32)
    return 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / H + eps)


@triton.jit
def _normed(x, inv, w_ptr, cols, ok, dt: tl.constexpr):
    """Elements `cols` of the normed row: x * inv rounded to the row's dtype, times the weight,
    rounded to `dt`. Elementwise, so any subset of the row's elements gets the row's bits."""
    y = (x.to(tl.float32) * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return (w * y.to(tl.float32)).to(dt)


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Neox RoPE of the halves (x1, x2) in fp32."""
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


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
    out = _normed(x, _inv_rms(x, H, eps), w_ptr, cols, ok, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * H + cols, out, mask=ok)


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


# debug=True compiles the kernels' device_assert (Triton drops it otherwise), launched with
# ASSERTS_ONLY so that is all it adds: a position outside the table, or an id outside the vocab,
# stops the kernel inside a captured graph without a host read or an extra launch.
ASSERTS_ONLY = {"sanitize_overflow": False}
"""Launch options of a debug=True kernel: its own asserts, not Triton's integer-overflow ones."""


@triton.jit(debug=True)
def _rope_kernel(
    x_ptr, pos_ptr, table_ptr, out_ptr, heads, rows, stride_xt, stride_xh, stride_table,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    tl.device_assert((pos >= 0) & (pos < rows), "rope: a position is outside the table")
    i = tl.arange(0, HALF)
    hh = tl.arange(0, HEADS)
    ok = (hh < heads)[:, None]
    cos = tl.load(table_ptr + pos * stride_table + i)[None, :]
    sin = tl.load(table_ptr + pos * stride_table + HALF + i)[None, :]
    at = t * stride_xt + hh[:, None] * stride_xh + i[None, :]
    o1, o2 = _rotate(tl.load(x_ptr + at, mask=ok, other=0.0),
                     tl.load(x_ptr + at + HALF, mask=ok, other=0.0), cos, sin)  # fmt: skip
    o = t * heads * 2 * HALF + hh[:, None] * 2 * HALF + i[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + o, o1.to(dt), mask=ok)
    tl.store(out_ptr + o + HALF, o2.to(dt), mask=ok)


def rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] at `positions` [T] (neox halves); returns x's dtype. The
    gradient is the plain torch rotation's."""
    return exact_with_native_grad(
        lambda x_: _rope_exact(x_, positions, table),
        lambda x_: _torch_rope.rope(x_, positions.to(x_.device), table.to(x_.device)),
        x,
    )


def _check_rope(d: int, positions: torch.Tensor, table: torch.Tensor) -> None:
    """What the rope kernels need: a table for head_dim d, d twice a power of 2, positions
    inside the table (`_check_positions`)."""
    half = d // 2
    if table.shape[-1] != 2 * half or d % 2:
        raise ValueError(f"rope: table is for head_dim {table.shape[-1]}, x has {d}")
    if half & (half - 1):
        raise ValueError(f"rope: head_dim {d} must be twice a power of 2 on CUDA")
    _check_positions(positions, table.shape[0])


_CHECKED: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}
"""id(positions) -> (the tensor, (its version, the table's rows)) of the last range check."""


def _check_positions(positions: torch.Tensor, rows: int) -> None:
    """Every position in [0, rows), read back on the host once per positions tensor and
    version: a forward's layers share one positions tensor, so an eager forward syncs once for
    it, not once a layer. Inference tensors keep no version, so each call reads them back.
    While a CUDA graph is captured nothing is read: the kernels assert each position they load
    on the device."""
    if not positions.numel() or _capturing():
        return
    stamp = None if positions.is_inference() else (positions._version, rows)
    seen = _CHECKED.get(id(positions))
    if stamp is not None and seen is not None and seen[0]() is positions and seen[1] == stamp:
        return
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()
    if lo < 0 or hi >= rows:
        raise ValueError(f"rope: positions {lo}..{hi} are outside the table's {rows} positions")
    if stamp is not None:
        for key in [k for k, (ref, _) in _CHECKED.items() if ref() is None]:
            del _CHECKED[key]
        _CHECKED[id(positions)] = (weakref.ref(positions), stamp)


def _rope_exact(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    t, heads, d = x.shape
    half = d // 2
    _check_rope(d, positions, table)
    table = table.to(x.device, torch.float32).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](x, positions.to(x.device).contiguous(), table, out, heads,
                           table.shape[0], x.stride(0), x.stride(1), table.stride(0), HALF=half,
                           HEADS=next_power_of_2(heads), **ASSERTS_ONLY)  # fmt: skip
    return out


@triton.jit(debug=True)
def _norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, table_ptr, q_out_ptr, k_out_ptr, q_heads, k_heads,
    rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_table, H, eps,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per (token, head) of q's heads then k's: `_rms_norm_kernel`'s body on the
    head, its normed row stored to the output; then, after a barrier, `_rope_kernel`'s rotation
    of the halves loaded back from the output. A program picks q's or k's pointers and nothing
    else, so both run the same code. The rotation's inputs are loads, as in `_rope_kernel`, so
    the compiler sees the same arithmetic (an fp32 product kept in registers could be
    contracted into the rotation's fma)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    is_q = j < q_heads
    h = tl.where(is_q, j, j - q_heads).to(tl.int64)
    x_row = tl.where(is_q, q_ptr + t * stride_qt + h * stride_qh,
                     k_ptr + t * stride_kt + h * stride_kh)  # fmt: skip
    w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
    out = tl.where(is_q, q_out_ptr + (t * q_heads + h) * H, k_out_ptr + (t * k_heads + h) * H)
    dt: tl.constexpr = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_row + cols, mask=ok, other=0.0)
    tl.store(out + cols, _normed(x, _inv_rms(x, H, eps), w_ptr, cols, ok, dt), mask=ok)
    tl.debug_barrier()
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    tl.device_assert((pos >= 0) & (pos < rows), "rope: a position is outside the table")
    cos = tl.load(table_ptr + pos * stride_table + i)
    sin = tl.load(table_ptr + pos * stride_table + HALF + i)
    o1, o2 = _rotate(tl.load(out + i), tl.load(out + HALF + i), cos, sin)
    tl.debug_barrier()  # every thread has loaded both halves before any overwrites them
    tl.store(out + i, o1.to(dt))
    tl.store(out + HALF + i, o2.to(dt))


def _aligned_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as the kernel reads it: unit stride within a head, and its head and token
    strides multiples of 16 elements (as a contiguous [T * heads, D] row is for D a multiple of
    16), else a contiguous copy: the alignment Triton sees decides the norm's layout."""
    if (
        x.stride(-1) == 1
        and x.stride(0) % 16 == 0
        and x.stride(1) % 16 == 0
        and (x.data_ptr() % 16 == 0)
    ):
        return x
    return x.contiguous()


def _qk_norm_rope_exact(q, k, q_weight, k_weight, eps, positions, table):
    t, q_heads, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share T "
                         "and head_dim")  # fmt: skip
    if q_weight.shape[-1] != d or k_weight.shape[-1] != d:
        raise ValueError(f"qk_norm_rope: norm weights of {q_weight.shape[-1]} and "
                         f"{k_weight.shape[-1]} elements, heads of {d}")  # fmt: skip
    if q.dtype != k.dtype:
        raise ValueError(f"qk_norm_rope: q is {q.dtype}, k is {k.dtype}")
    _check_rope(d, positions, table)
    table = table.to(q.device, torch.float32).contiguous()
    positions = positions.to(q.device).contiguous()
    block, warps = _width_config(d)
    q, k = _aligned_heads(q), _aligned_heads(k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() + k.numel():  # one launch for q and k: one kernel fewer a layer
        _norm_rope_kernel[(t, q_heads + k.shape[1])](
            q, k, q_weight.contiguous(), k_weight.contiguous(), positions, table, q_out, k_out,
            q_heads, k.shape[1], table.shape[0], q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), table.stride(0), d, eps, HALF=d // 2, BLOCK=block, num_warps=warps,
            **ASSERTS_ONLY,
        )  # fmt: skip
    return q_out, k_out


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """rope(rms_norm(q)), rope(rms_norm(k)) for q [T, Hq, D] and k [T, Hkv, D] (views into one
    qkv row are read in place): one launch for both, the bits of the two ops. The gradient is
    that of the plain torch steps."""
    return exact_with_native_grad(
        lambda q_, k_, qw, kw: _qk_norm_rope_exact(q_, k_, qw, kw, eps, positions, table),
        lambda q_, k_, qw, kw: _qk_norm_rope_native(q_, k_, qw, kw, eps, positions, table),
        q, k, q_weight, k_weight,
    )  # fmt: skip


def _qk_norm_rope_native(q, k, q_weight, k_weight, eps, positions, table):
    pos, tab = positions.to(q.device), table.to(q.device)
    return (_torch_rope.rope(_torch_norm.rms_norm(q, q_weight, eps), pos, tab),
            _torch_rope.rope(_torch_norm.rms_norm(k, k_weight, eps), pos, tab))  # fmt: skip


@triton.jit
def _swiglu(g, u):
    """silu(g) * u in fp32, rounded once to g's dtype: `silu_mul`'s steps, which the MoE's
    down projection also runs on the rows it loads (`linear._segment`)."""
    gf = g.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype)


@triton.jit(do_not_specialize=["n"])  # n grows with the batch (warmup.py)
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(g_ptr + i, mask=ok, other=0.0)
    u = tl.load(u_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, _swiglu(g, u), mask=ok)


def _silu_mul_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    if g.numel():
        _silu_mul_kernel[(cdiv(g.numel(), 1024),)](g, u, out, g.numel(), BLOCK=1024)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to gate's dtype; the gradient is F.silu's."""
    return exact_with_native_grad(_silu_mul_exact, silu_mul_native, gate, up)


@triton.jit(debug=True)
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, V, H, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.device_assert((row >= 0) & (row < V), "embedding: a token id is outside the vocab")
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    tl.store(out_ptr + t * H + cols, tl.load(w_ptr + row * H + cols, mask=ok), mask=ok)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of `weight` [V, H] at `ids`; out-of-range ids are refused, naming the first."""
    v, h = weight.shape
    flat = ids.reshape(-1).to(weight.device)
    # A gather past the table would read other memory silently. While a CUDA graph is captured
    # the host cannot read the ids: the kernel asserts each id on the device.
    if not _capturing():
        outside = (flat < 0) | (flat >= v)
        if bool(outside.any()):
            raise IndexError(f"embedding: token id {int(flat[outside][0])} is outside the vocab "
                             f"of {v}")  # fmt: skip
    out = torch.empty(flat.numel(), h, dtype=weight.dtype, device=weight.device)
    if flat.numel():
        _embedding_kernel[(flat.numel(), cdiv(h, 1024))](
            flat.contiguous(), weight.contiguous(), out, v, h, BLOCK=1024, **ASSERTS_ONLY
        )
    return out.view(*ids.shape, h)


# A slot outside the cache stops the kernel as index_copy_'s bounds check does (`ASSERTS_ONLY`).
# The stores are masked to the cache as well, so no write lands outside it where the assert does
# not run (Triton's interpreter).
@triton.jit(debug=True)
def _kv_store_kernel(k_ptr, v_ptr, slots_ptr, k_cache, v_cache, capacity, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cs, stride_ch, D: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
    """Program (row, head): that head's D keys and D values of the row, to the row's slot."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    inside = (slot >= 0) & (slot < capacity)
    tl.device_assert(inside, "kv_store: a slot is outside the cache")
    cols = tl.arange(0, BLOCK)
    ok = (cols < D) & inside
    dst = slot * stride_cs + h * stride_ch + cols
    tl.store(k_cache + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + cols, mask=ok), mask=ok)
    tl.store(v_cache + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=ok), mask=ok)


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:  # fmt: skip
    """k_cache[slots] = k and v_cache[slots] = v in one launch (two `index_copy_` before): rows
    [n, kv_heads, head_dim] read in place (a view into the qkv row), caches [slots, kv_heads,
    head_dim] with unit stride within a head and one layout for both."""
    check_kv_store(k_cache, v_cache, slots, k, v)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"kv_store: caches of strides {k_cache.stride()} and {v_cache.stride()} "
                         "must share one layout with unit stride within a head")  # fmt: skip
    n, heads, d = k.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if n and heads and d:
        block = next_power_of_2(d)
        _kv_store_kernel[(n, heads)](
            k, v, slots.contiguous(), k_cache, v_cache, k_cache.shape[0], k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), D=d,
            BLOCK=block, num_warps=max(1, min(4, block // 128)), **ASSERTS_ONLY,
        )  # fmt: skip
