"""Exact log-softmax and per-token log-probs (CPU); the vocab-parallel log-probs are
`compose.vocab_parallel_token_logprobs` over this module's `sumexp_partial`.

For a row x of V logits (fp32):
1. M = max(x), exact in any order;
2. S = sum(exp(x - M)) by a fixed tree: V is cut into `vocab_segments(V)` equal segments, each
   summed by the block tree, and the segment sums by the pairwise tree;
3. log_softmax(x) = x - (M + log(S)).
A vocab-parallel shard holding whole segments computes the same exp(x - M) elements once M is
all-reduced (max is exact) and the same segment subtrees; the pairwise tree over the shards'
partials then equals the full tree. So the vocab-parallel result is the full one bit for bit.

Log-probs follow SGLang's on-policy rule: logits divided by the temperature (only when it is
not 1) and rounded back to the logits' dtype, then the fp32 log-softmax.
"""

from __future__ import annotations

import torch

from onpolicy.kernels.compose import logsumexp, scale_logits
from onpolicy.kernels.rules import K_BLOCK
from onpolicy.kernels.tree import pairwise_tree_sum, tree_sum


def _segment_sums(e: torch.Tensor, n_segments: int) -> torch.Tensor:
    """[..., V] -> [..., n_segments]: each equal segment summed by the block tree."""
    seg = e.reshape(*e.shape[:-1], n_segments, e.shape[-1] // n_segments)
    return tree_sum(seg, dim=-1, block=K_BLOCK)


def sumexp_partial(shard: torch.Tensor, vmax: torch.Tensor, n_segments: int) -> torch.Tensor:
    """A vocab shard's share of S: its `n_segments` segments of exp(x - vmax), tree-summed.

    `vmax` [...] is the max over the *full* vocab; the partials of all shards are combined
    with `pairwise_tree_sum` in shard order.
    """
    sums = _segment_sums(torch.exp(shard.float() - vmax[..., None]), n_segments)
    return pairwise_tree_sum(sums.movedim(-1, 0))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim, in the fixed segment-tree order."""
    xf = x.float()
    return xf - logsumexp(sumexp_partial, xf)[..., None]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """log p(tokens) [T] fp32 under log_softmax(logits / temperature), logits [T, V]."""
    lp = log_softmax(scale_logits(logits, temperature))
    return lp.gather(-1, tokens[..., None].long())[..., 0]
