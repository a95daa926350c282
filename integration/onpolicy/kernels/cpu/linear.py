"""Exact linear (CPU): rows independent of M, K in fixed 128-wide blocks, pairwise-tree order.

The reduction is spelled out element by element, never handed to BLAS:
1. products x[m, k] * w[n, k] in fp32 (exact for bf16 inputs: 8+8 mantissa bits fit in 24);
2. within each K-block, the products are summed by `pairwise_tree_sum` over k;
3. the block sums are summed by `pairwise_tree_sum` over the block index.

Every step is elementwise fp32 arithmetic in a fixed order, so an output element depends only
on its own row of x and row of w: not on M, on the row's position, or on how rows are chunked.

Segments (`rules.k_segments`): K is cut into S equal segments, each summed as above, and the S
segment sums are added by `pairwise_tree_sum`. A row-parallel shard of S / tp whole segments
computes an aligned subtree, so its partial (`linear_partial`), combined across the shards by
the same tree (`combine_partials`), is the unsharded sum bit for bit
(`rules.row_parallel_exact(k, tp, S)`). Where K and S are powers of 2 the segment tree is the
block tree itself: S changes no bits there.
"""

from __future__ import annotations

import torch

from onpolicy.kernels import autograd as _shared
from onpolicy.kernels.rules import K_BLOCK
from onpolicy.kernels.tree import combine_partials, pairwise_tree_sum, tree_sum

_CHUNK_ELEMS = 1 << 22
"""Products materialised at once (16 MiB of fp32); rows are chunked to stay under it."""


def _tree_matmul_fp32(x: torch.Tensor, w: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """x [M, K] @ w[N, K].T in fp32: K in `segments` equal segments, each summed by the fixed
    block tree, the segment sums by the pairwise tree; M may be anything, including 0."""
    m, k = x.shape
    n = w.shape[0]
    xf, wf = x.float(), w.float()
    if k == 0 or m == 0:
        return xf.new_zeros(m, n)
    seg = k // segments
    rows = max(1, _CHUNK_ELEMS // max(1, k * n))
    # Products laid out [K, rows, N]: the reduction index leads, so a tree level is one big add.
    outs = []
    for r in range(0, m, rows):
        prods = xf[r : r + rows].T[:, :, None] * wf.T[:, None, :]
        sums = [tree_sum(prods[s : s + seg], dim=0, block=K_BLOCK) for s in range(0, k, seg)]
        outs.append(pairwise_tree_sum(sums) if segments > 1 else sums[0])
    return torch.cat(outs)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """fp32 x @ weight.T over this weight's K only, K in `segments` segments: the block tree
    in each, the tree over them, no bias, not rounded.

    weight is [N, K] (a row-parallel shard holds a K-slice). The result feeds
    `combine_partials` (or a tree all-reduce over ranks, then the same bias-and-cast).
    """
    return _shared.linear_partial(_tree_matmul_fp32, x, weight, segments)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, segments: int = 1
) -> torch.Tensor:
    """x @ weight.T (+ bias) with weight [N, K]: the unsharded case of the row-parallel path."""
    return combine_partials([linear_partial(x, weight, segments)], x.dtype, bias)
