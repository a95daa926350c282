"""The sampling noise (CPU): a keyed 32-bit hash of each vocabulary column, as a uniform.

For a row with key words (k0, k1) and column j: h = mix(mix(j ^ k0) ^ k1), mix the lowbias32
mixer (C. Wellons' hash-prospector), all arithmetic modulo 2^32; the uniform is
((h >> 9) + 0.5) / 2^23, exact in fp32 and never 0 or 1. Integer arithmetic has one answer, so
every backend gives the same bits. Here it is int64 torch ops on words below 2^32, each 32-bit
product taken by the constant's 16-bit halves so that no int64 product overflows (overflow is
not defined alike on every device).
"""

from __future__ import annotations

import torch

NOISE_BITS = 23
"""Bits of a uniform: (k + 0.5) / 2^23 is exact in fp32."""
MIX = (0x7FEB352D, 0x846CA68B)
"""lowbias32's two multipliers."""
_M32 = 0xFFFF_FFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32, in place, for int64 x in [0, 2^32)."""
    hi = x * (c >> 16)
    hi &= 0xFFFF
    hi <<= 16
    x *= c & 0xFFFF
    x += hi
    x &= _M32
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place: a bijection of 32-bit words with full avalanche."""
    x ^= x >> 16
    x = _mul32(x, MIX[0])
    x ^= x >> 15
    x = _mul32(x, MIX[1])
    x ^= x >> 16
    return x


def uniform_noise(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] fp32 uniforms in (0, 1) from words [R, 2] int64 (each in [0, 2^32))."""
    h = torch.arange(vocab, dtype=torch.int64, device=words.device) ^ words[:, :1]
    h = _mix32(h)
    h ^= words[:, 1:]
    h = _mix32(h)
    h >>= 32 - NOISE_BITS
    return (h.to(torch.float32) + 0.5) * 2.0**-NOISE_BITS
