"""The sampling noise (CUDA): `kernels.cpu.noise` in one Triton kernel, in uint32 arithmetic
(wrapping modulo 2^32, as the CPU backend's split products compute it). One program per (row,
block of columns); the bits equal the CPU backend's (tests/gpu/test_sampling_cuda.py, and under
the interpreter tests/unit/cuda_interpreted.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onpolicy.kernels.cpu.noise import MIX, NOISE_BITS
from onpolicy.kernels.rules import cdiv

BLOCK = 1024
"""Columns per program."""


@triton.jit
def _mix32(x, m0, m1):
    x = x ^ (x >> 16)
    x = x * m0
    x = x ^ (x >> 15)
    x = x * m1
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["vocab"])
def _noise_kernel(words_ptr, out_ptr, vocab, M0: tl.constexpr, M1: tl.constexpr,
                  BITS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k0 = tl.load(words_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(words_ptr + 2 * row + 1).to(tl.uint32)
    m0 = tl.full([BLOCK], M0, tl.uint32)
    m1 = tl.full([BLOCK], M1, tl.uint32)
    h = _mix32(cols.to(tl.uint32) ^ k0, m0, m1)
    h = _mix32(h ^ k1, m0, m1)
    u = ((h >> (32 - BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
    tl.store(out_ptr + row * vocab + cols, u, mask=cols < vocab)


def uniform_noise(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] fp32 uniforms in (0, 1) from words [R, 2] int64 (each in [0, 2^32))."""
    words = words.contiguous()
    out = torch.empty(words.shape[0], vocab, dtype=torch.float32, device=words.device)
    if out.numel():
        _noise_kernel[(words.shape[0], cdiv(vocab, BLOCK))](
            words, out, vocab, M0=MIX[0], M1=MIX[1], BITS=NOISE_BITS, BLOCK=BLOCK
        )
    return out
