"""Exact log-softmax and per-token log-probs (CUDA), full and vocab-parallel.

The arithmetic of the CPU backend's segment tree, with the per-segment sums in a kernel: one
program per (row, segment) walks its segment in fixed 1024-wide chunks, accumulating exp(x - M)
elementwise into a 1024-lane fp32 vector, and ends with one `tl.sum`. A segment's sum therefore
depends on its own elements only; segments combine by the pairwise tree in segment order, and a
vocab-parallel shard holding whole segments computes the same segment sums, so its partial,
tree-combined across shards, is the full sum bit for bit. M is a max (exact in any order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.compose import logsumexp, scale_logits
from onpolicy.kernels.compose import vocab_parallel_token_logprobs as vocab_parallel
from onpolicy.kernels.tree import pairwise_tree_sum

CHUNK = 1024
"""Lanes of a segment program's accumulator."""


@triton.jit
def _segment_sumexp_kernel(x_ptr, vmax_ptr, out_ptr, width, stride_x, n_seg, BLOCK: tl.constexpr):
    row, seg = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = x_ptr + row * stride_x + seg.to(tl.int64) * width
    vmax = tl.load(vmax_ptr + row)
    acc = tl.zeros((BLOCK,), tl.float32)
    for lo in range(0, width, BLOCK):
        cols = lo + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - vmax)
    tl.store(out_ptr + row * n_seg + seg, tl.sum(acc, 0))


def sumexp_partial(shard: torch.Tensor, vmax: torch.Tensor, n_segments: int) -> torch.Tensor:
    """A vocab shard's share of S: its `n_segments` segments of exp(x - vmax), tree-summed.
    shard [..., W], vmax [...] fp32 (the max over the full vocab)."""
    x = shard.reshape(-1, shard.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, w = x.shape
    sums = torch.empty(t, n_segments, dtype=torch.float32, device=shard.device)
    if t:
        _segment_sumexp_kernel[(t, n_segments)](
            x, vmax.float().reshape(-1).contiguous(), sums, w // n_segments, x.stride(0),
            n_segments, BLOCK=CHUNK, num_warps=4,
        )  # fmt: skip
    return pairwise_tree_sum(sums.movedim(-1, 0)).view(shard.shape[:-1])


def _log_softmax_exact(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf - logsumexp(sumexp_partial, xf)[..., None]


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim, in the fixed segment-tree order."""
    return exact_with_native_grad(
        _log_softmax_exact, lambda x_: torch.log_softmax(x_.float(), -1), x
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """log p(tokens) [T] fp32 under log_softmax(logits / temperature), logits [T, V]; the
    gradient is torch.log_softmax's."""
    idx = tokens.to(logits.device)[..., None].long()

    def exact(x: torch.Tensor) -> torch.Tensor:
        xf = scale_logits(x, temperature).float()
        return xf.gather(-1, idx)[..., 0] - logsumexp(sumexp_partial, xf)

    def native(x: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(scale_logits(x, temperature).float(), -1)
        return lp.gather(-1, idx)[..., 0]

    return exact_with_native_grad(exact, native, logits)


def vocab_parallel_token_logprobs(
    shards: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """`token_logprobs` from vocab shards [T, V/tp], combined as tp ranks would: equal to the
    full one bit for bit when each shard holds whole segments (forward only)."""
    detached = [s.detach() for s in shards]
    return vocab_parallel(sumexp_partial, detached, tokens, temperature)
