"""Bitwise comparison of tensors: the one definition of "the same bits" every check uses.

Two float tensors are bitwise equal when their integer views are equal. That is stricter than
`torch.equal`, which compares values: it calls -0.0 equal to +0.0, and NaN unequal to itself.
A log-prob that is -0.0 on one side and +0.0 on the other is a different number to anything
that hashes, serialises or sums it in another order, so exactness is judged on the bits.
"""

from __future__ import annotations

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a same-shape signed integer tensor (int16 for bf16, int32 for fp32)."""
    if t.dtype == torch.bool:
        return t.to(torch.int8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.detach().contiguous().view(_INT_VIEW[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape and the same bits in every element."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(as_bits(a).cpu(), as_bits(b).cpu())


def n_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shape, same-dtype tensors differ in their bits."""
    return int((as_bits(a).cpu() != as_bits(b).cpu()).sum())


def hex_bits(t: torch.Tensor) -> str:
    """One element's bits in hex, as wide as its dtype (0x3f80 for bf16 1.0)."""
    width = t.element_size()
    return f"0x{int(as_bits(t.reshape(1))[0]) & ((1 << (8 * width)) - 1):0{2 * width}x}"


def mismatch_report(a: torch.Tensor, b: torch.Tensor) -> str:
    """Why two tensors are not bitwise equal: dtype, shape, or the count of differing elements,
    the largest difference and the first differing index with both values and their bits."""
    if a.dtype != b.dtype:
        return f"dtypes differ: {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = as_bits(a).cpu() != as_bits(b).cpu()
    n = int(diff.sum())
    if n == 0:
        return "bitwise equal"
    first = tuple(int(i) for i in torch.nonzero(diff)[0])
    x, y = a.detach().cpu()[first], b.detach().cpu()[first]
    out = f"{n} of {a.numel()} elements differ; first at {first}: {float(x)!r} ({hex_bits(x)}) "
    out += f"vs {float(y)!r} ({hex_bits(y)})"
    if a.is_floating_point():
        delta = (a.detach().double() - b.detach().double()).abs()
        out += f"; max |delta| {float(delta[diff.to(delta.device)].max()):.3e}"
    return out


_DIGEST_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def row_digests(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row of a [N, V] fp32 tensor: sum_j bits_j * w_j modulo 2^64, with bits_j
    the j-th entry's 32 bits as an unsigned number and w_j a fixed odd weight below 2^31 (a
    seeded draw per V). An integer sum wraps the same in any order, so the digest is the same
    on every device and reduction; any one changed entry changes it (w_j is odd, so bits_j *
    w_j differs modulo 2^64 whenever bits_j does)."""
    if rows.dtype != torch.float32 or rows.dim() != 2:
        raise ValueError(f"row_digests: want [N, V] float32, got {tuple(rows.shape)} {rows.dtype}")
    v, dev = rows.shape[1], rows.device
    w = _DIGEST_WEIGHTS.get((v, str(dev)))
    if w is None:
        g = torch.Generator().manual_seed(v)
        w = (torch.randint(0, 2**30, (v,), generator=g, dtype=torch.int64) * 2 + 1).to(dev)
        _DIGEST_WEIGHTS[v, str(dev)] = w
    bits = as_bits(rows).to(torch.int64) & 0xFFFFFFFF  # < 2^32, times w < 2^31: no overflow
    return (bits * w).sum(dim=-1)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Raise AssertionError with `mismatch_report` unless a and b are bitwise equal."""
    if not bitwise_equal(a, b):
        raise AssertionError(f"{what + ': ' if what else ''}{mismatch_report(a, b)}")
