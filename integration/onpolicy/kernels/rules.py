"""The reduction layouts every backend follows, and when a sharded sum keeps the unsharded bits.

A backend may tile however it likes inside these rules, but not change them: they fix which
partial sums exist, and so which splits (TP, vocab-parallel) are exact.
"""

from __future__ import annotations

K_BLOCK = 128
"""Width of one K-block of a matmul, and of one block of every other long sum."""

MMA_LEAF = 512
"""The CUDA backend's tree leaf: it sums MMA_LEAF / K_BLOCK consecutive K-blocks by chained
tensor-core products (the hardware's order) and applies the pairwise tree above that width. On
CUDA a row-parallel shard must therefore hold whole leaves."""

KV_BLOCK = 64
"""Keys per attention block: keys [0, B), [B, 2B), ... are folded into the softmax in order."""

VOCAB_SEGMENTS = 8
"""The vocab sum of a log-softmax is a tree over this many equal segments (fewer if V does not
divide): vocab-parallel shards are then unions of whole segments at TP 1, 2, 4 and 8."""


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def row_parallel_exact(k: int, tp: int, device: str = "cpu") -> bool:
    """Whether splitting a matmul's K = `k` into `tp` equal contiguous shards keeps its bits.

    True when tp is 1, or when tp is a power of 2 dividing k and each shard's width k/tp is a
    power of 2: then a shard is either a power-of-2 count of whole K-blocks or a power-of-2
    slice of the single block, an aligned subtree of the fixed pairwise tree either way.
    On "cuda" a shard must also hold whole MMA_LEAF-wide leaves: inside a leaf the tensor
    core's order is not a pairwise tree, so a slice of one leaf is not a subtree there.
    Qwen3-30B-A3B's expert K = 768 at tp 2 gives 384 = 3 blocks per shard: not exact.
    """
    if tp == 1:
        return True
    if not is_power_of_2(tp) or k % tp:
        return False
    if device == "cuda" and (k // tp) % MMA_LEAF:
        return False
    return is_power_of_2(k // tp)


def vocab_segments(vocab: int) -> int:
    """How many equal segments the log-softmax sum of a `vocab`-wide row is cut into."""
    s = VOCAB_SEGMENTS
    while vocab % s:
        s //= 2
    return s


def vocab_parallel_exact(vocab: int, tp: int) -> bool:
    """Whether a vocab-parallel log-softmax over `tp` equal shards keeps the full one's bits."""
    return is_power_of_2(tp) and vocab_segments(vocab) % tp == 0
