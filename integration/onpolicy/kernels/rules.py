"""The reduction layouts every backend follows, and when a sharded sum keeps the unsharded bits.

A backend may tile however it likes inside these rules, but not change them: they fix which
partial sums exist, and so which splits (TP, vocab-parallel) are exact. A matmul's K is cut
into `k_segments` equal segments, fixed per matmul for the whole run by the contract; how a
backend sums inside one segment is its own fixed order.
"""

from __future__ import annotations

from collections.abc import Iterable

K_BLOCK = 128
"""Width of one K-block of a matmul, and of one block of every other long sum."""

KV_BLOCK = 64
"""Keys per attention block: keys [0, B), [B, 2B), ... are folded into the softmax in order."""

VOCAB_SEGMENTS = 8
"""The vocab sum of a log-softmax is a tree over this many equal segments (fewer if V does not
divide): vocab-parallel shards are then unions of whole segments at TP 1, 2, 4 and 8."""


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's launch arithmetic: `triton.cdiv` is a constexpr function, whose
    host call costs about 2 us (a GEMM's launch made four)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1), on the host, as `cdiv` replaces `triton.cdiv`."""
    return 1 << (n - 1).bit_length()


def k_segments(k: int, tps: Iterable[int]) -> int:
    """S for a matmul whose K = `k` is cut over TP on some side of a run: the largest of `tps`
    (the TPs that cut this K, on either side) that divides k, 1 when none does (an unsplit K).

    Every backend cuts K into S equal contiguous segments, reduces each segment in its own
    fixed order (CPU: the K_BLOCK block tree; CUDA: one chained tensor-core accumulation) and
    adds the S segment partials by the pairwise tree. A rank that holds S / tp segments of it
    (`row_parallel_exact`) then computes an aligned subtree, and the tree all-reduce over the
    ranks is the S-tree itself. S = 1 is a plain GEMM.
    """
    cuts = [t for t in tps if t > 1 and k % t == 0]
    return max(cuts, default=1)


def row_parallel_exact(k: int, tp: int, segments: int) -> bool:
    """Whether `tp` equal contiguous shards of a K = `k` cut into `segments` segments keep the
    unsharded bits: each shard must hold an aligned power-of-2 count of whole segments, i.e.
    segments divides k, tp divides segments and segments / tp is a power of 2. The shard's
    partial (its segments' tree) is then a subtree of the segment tree, and the tree over the
    shards in rank order is the whole tree. Qwen3-30B-A3B's expert K = 768 at MoE TP 2 is exact
    with S = 2 (two 384-wide segments), at TP 4 with S = 4.
    """
    if segments < 1 or tp < 1 or k % segments or segments % tp:
        return False
    return is_power_of_2(segments // tp)


def check_segments(k: int, segments: int) -> None:
    """Refuse a segment count that does not cut K into equal segments."""
    if segments < 1 or k % segments:
        raise ValueError(
            f"linear: segments = {segments} must be >= 1 and divide K = {k} (K is cut into "
            "equal segments, rules.k_segments)"
        )


def vocab_segments(vocab: int) -> int:
    """How many equal segments the log-softmax sum of a `vocab`-wide row is cut into."""
    s = VOCAB_SEGMENTS
    while vocab % s:
        s //= 2
    return s


def vocab_parallel_exact(vocab: int, tp: int) -> bool:
    """Whether a vocab-parallel log-softmax over `tp` equal shards keeps the full one's bits."""
    return is_power_of_2(tp) and vocab_segments(vocab) % tp == 0
