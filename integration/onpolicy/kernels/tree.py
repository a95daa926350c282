"""The one reduction order every exact op and collective shares: a fixed pairwise tree.

Level by level, neighbours are added (0+1, 2+3, ...); an odd last element is carried up
unchanged. For a power-of-2 count the tree is perfectly balanced, so the sum of a contiguous,
aligned power-of-2 slice of the parts is a subtree. That is why a row-parallel shard's partial
(the tree over its own K-blocks), combined by the same tree across shards, equals the unsharded
tree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pairwise_tree_sum(parts: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Sum `parts` (a sequence, or the leading dim of a tensor) in the fixed pairwise tree order.

    The arithmetic happens in the parts' own dtype; callers pass fp32 accumulators.
    """
    level = torch.stack(list(parts)) if not isinstance(parts, torch.Tensor) else parts
    if level.shape[0] == 0:
        raise ValueError("pairwise_tree_sum needs at least one part, got 0")
    while level.shape[0] > 1:
        n = level.shape[0]
        paired = level[0 : n - n % 2 : 2] + level[1 : n - n % 2 : 2]
        level = torch.cat([paired, level[n - 1 :]]) if n % 2 else paired
    return level[0]


def tree_sum(x: torch.Tensor, dim: int = -1, block: int | None = None) -> torch.Tensor:
    """Sum x over `dim` in the fixed order every exact op shares, removing `dim`.

    With `block`, `dim` is cut into consecutive blocks of `block` elements (the last one may be
    shorter) when it is longer than one block; each block is summed by `pairwise_tree_sum` over
    its elements and the block sums by `pairwise_tree_sum` over the block index. Without
    `block`, the whole dim is one tree. Only elementwise adds are used, so each output element
    depends on its own slice of x alone, never on the other dims' sizes.
    """
    lead = x.movedim(dim, 0)
    n = lead.shape[0]
    if block is None or n <= block:
        return pairwise_tree_sum(lead)
    n_full, tail = divmod(n, block)
    sums = []
    if n_full:
        full = lead[: n_full * block].reshape(n_full, block, *lead.shape[1:])
        sums.append(pairwise_tree_sum(full.transpose(0, 1)))
    if tail:
        sums.append(pairwise_tree_sum(lead[n_full * block :])[None])
    return pairwise_tree_sum(torch.cat(sums) if len(sums) > 1 else sums[0])


def combine_partials(
    partials: Sequence[torch.Tensor], out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum row-parallel shards' fp32 partials by the pairwise tree in shard order, add the bias
    in fp32, cast to `out_dtype`: the last step of every exact linear, sharded or not."""
    out = pairwise_tree_sum([p.float() for p in partials])
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
