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
