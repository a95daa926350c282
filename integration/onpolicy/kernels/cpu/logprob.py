"""Exact log-softmax and per-token log-probs (CPU), full and vocab-parallel.

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

from collections.abc import Callable, Sequence

import torch

from onpolicy.kernels.rules import K_BLOCK, vocab_parallel_exact, vocab_segments
from onpolicy.kernels.tree import pairwise_tree_sum, tree_sum

SumExp = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(x [..., W] fp32, full-vocab max [...], segments) -> the tree sum of exp(x - max) over
x's segments: the one piece each backend computes its own way."""


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


def logsumexp(xf: torch.Tensor, sumexp: SumExp | None = None) -> torch.Tensor:
    """fp32 log-sum-exp over the last dim: max, then the backend's segment sums (`sumexp`,
    default this module's) combined by the tree."""
    vmax = xf.amax(dim=-1).detach()
    return vmax + torch.log((sumexp or sumexp_partial)(xf, vmax, vocab_segments(xf.shape[-1])))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim, in the fixed segment-tree order."""
    xf = x.float()
    return xf - logsumexp(xf)[..., None]


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature rounded to the logits' dtype; untouched when the temperature is 1."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if temperature == 1.0:
        return logits
    return (logits.float() / temperature).to(logits.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """log p(tokens) [T] fp32 under log_softmax(logits / temperature), logits [T, V]."""
    lp = log_softmax(scale_logits(logits, temperature))
    return lp.gather(-1, tokens[..., None].long())[..., 0]


def vocab_parallel_token_logprobs(
    shards: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0,
    sumexp: SumExp | None = None,
) -> torch.Tensor:  # fmt: skip
    """`token_logprobs` from the LM head's vocab shards [T, V/tp] (in one process): what tp
    ranks compute with a max all-reduce and a tree all-reduce of `sumexp_partial` (or the
    backend's `sumexp`).

    Each shard must be a whole number of segments (`rules.vocab_parallel_exact`); then the
    result equals `token_logprobs` on the concatenated logits bit for bit.
    """
    tp = len(shards)
    width = shards[0].shape[-1]
    vocab = width * tp
    if any(s.shape[-1] != width for s in shards) or not vocab_parallel_exact(vocab, tp):
        raise ValueError(
            f"vocab_parallel_token_logprobs: {tp} shards of a {vocab}-wide vocab do not each hold "
            f"whole segments ({vocab_segments(vocab)} segments); use tp dividing that count"
        )
    xs = [scale_logits(s, temperature).float() for s in shards]
    vmax = torch.stack([x.amax(dim=-1) for x in xs]).amax(dim=0).detach()
    per_shard = vocab_segments(vocab) // tp
    total = pairwise_tree_sum([(sumexp or sumexp_partial)(x, vmax, per_shard) for x in xs])
    lse = vmax + torch.log(total)
    tokens = tokens.to(xs[0].device).long()
    owner, local = tokens // width, tokens % width
    picked = torch.stack([x.gather(-1, local[..., None])[..., 0] for x in xs])
    return picked.gather(0, owner[None])[0] - lse
