"""Compile the Triton variants a run will use at start, not on the first batch that needs them.

A variant is one compile of a kernel: its constexprs (tile, flags, segments), its launch
options, and how Triton specializes the other arguments (pointer alignment; an integer equal to
1 or divisible by 16). The integers that grow with the batch are left unspecialized
(`linear`, `attention`, `elementwise`), so a batch's variants follow only from the choices the
host makes from its shape: the GEMM's tile from the rows (`linear.ROW_BOUNDS`), the MoE's path
and tile from the (token, slot) pairs (`moe.SMALL_PAIRS`, `moe.SORTED_SMALL_TILE_MAX_PAIRS`;
the sorted path's schedule is one variant up to `moe.SCHEDULE_MAX_PAIRS`, torch ops above),
attention's tile from rows per request and its split from the keys and tiles
(`attention.split_for`). Each choice is a step function of the token count for a fixed kind of
batch, so batches on both sides of every step, of each kind, launch every variant that any
batch of at most `max_tokens` tokens launches (`warmup_batches`). `warm_up` runs them through
the caller's forward and counts the compiles.

Scope: packed prefill of whole sequences (the trainer's forward, and the reference model's
`score`), and with `request_bounds` an engine's extend batches (`rollout.warmup`). The paged
decode of an engine is warmed by its own graph capture.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from onpolicy.kernels.cuda import attention, linear, moe


@dataclass
class CompileLog:
    """Triton's compiles in this process, counted while `counting` is active (through
    `triton.knobs.compilation.listener`, handing on to a listener set before): per label, the
    seconds and number of real compiles (the cache missed) and the number of kernels loaded
    from the disk cache. A kernel the process already holds in memory is not counted."""

    by_label: dict[str, list[float]] = field(default_factory=dict)
    """label -> [compile seconds, compiles, disk-cache hits]."""

    @contextmanager
    def counting(self, label: str) -> Iterator[None]:
        from triton import knobs

        entry = self.by_label.setdefault(label, [0.0, 0, 0])
        saved = knobs.compilation.listener

        def heard(*, src, metadata, metadata_group, times, cache_hit) -> None:
            if cache_hit:
                entry[2] += 1
            else:
                entry[0] += times.total / 1e6
                entry[1] += 1
            if saved is not None:
                saved(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                      cache_hit=cache_hit)  # fmt: skip

        knobs.compilation.listener = heard
        try:
            yield
        finally:
            knobs.compilation.listener = saved

    def total(self) -> tuple[float, int, int]:
        """(compile seconds, compiles, disk-cache hits) over every label."""
        rows = list(self.by_label.values())
        return (sum(r[0] for r in rows), int(sum(r[1] for r in rows)),
                int(sum(r[2] for r in rows)))  # fmt: skip


def token_bounds(top_k: int, q_per_kv: int, kv_heads: int, max_tokens: int,
                 fp32: bool = False) -> list[int]:  # fmt: skip
    """Token counts T at which some host choice changes between T and T + 1, for a batch of one
    sequence or of T one-token sequences (attention's tiles follow the dtype)."""
    # The MoE's path, then its grouped tile (only past SMALL_PAIRS), in (token, slot) pairs.
    grouped = (*linear.ROW_BOUNDS, moe.SORTED_SMALL_TILE_MAX_PAIRS)
    pairs = (moe.SMALL_PAIRS, *(b for b in grouped if b > moe.SMALL_PAIRS))
    bounds = {*linear.ROW_BOUNDS, *(b // top_k for b in pairs), attention.KV_PARTITION,
              attention.FEW_REQUESTS}  # fmt: skip
    split = [c for c in range(attention.KV_PARTITION + 1, max_tokens + 1)
             if attention.split_for(_tiles([c], q_per_kv, fp32), kv_heads, c)]  # fmt: skip
    if split:
        bounds.add(split[-1])
    return sorted(b for b in bounds if 0 < b < max_tokens)


def request_bounds(q_per_kv: int, kv_heads: int, max_tokens: int, vocab: int,
                   fp32: bool = False) -> tuple[list[int], list[int]]:  # fmt: skip
    """Token counts T at which a choice changes between T and T + 1 for the two batches of an
    engine with one row per request: (T one-token requests, one request of a partition and a
    key among T - KV_PARTITION - 1 one-token ones). The choices: attention's tile and split on
    the device path (`attention._plan`: T * g // BLOCK_M + R tiles, the keys bounded by a page
    table wider than a partition), and, for the one-token batch, the tile of the GEMM over one
    row per request (the LM head over `vocab` columns: its row bounds and LARGE_M's waves; the
    other batch has fewer requests than a one-token batch of its T). Every other kernel sees
    the batch's T rows and picks by T alone."""
    long = attention.KV_PARTITION + 1

    def attend(tokens: int, requests: int) -> tuple:
        tile = attention.tile_for(tokens * q_per_kv, requests, fp32)
        tiles = tokens * q_per_kv // tile[0] + requests
        return tile, attention.split_for(tiles, kv_heads, 2 * attention.KV_PARTITION)

    ones = [(attend(t, t), linear.tile_for(t, vocab)) for t in range(1, max_tokens + 1)]
    longs = [attend(t, t - long + 1) if t > long else None for t in range(1, max_tokens + 1)]
    return tuple([t for t in range(1, max_tokens) if picks[t - 1] != picks[t]]
                 for picks in (ones, longs))  # fmt: skip


def _tiles(lengths: Sequence[int], q_per_kv: int, fp32: bool = False) -> int:
    """Attention's M-tiles for whole sequences of `lengths` (its schedule's count)."""
    bm = attention.tile_for(sum(lengths) * q_per_kv, len(lengths), fp32)[0]
    return sum(-(-n * q_per_kv // bm) for n in lengths)


def warmup_batches(max_tokens: int, top_k: int, q_per_kv: int, kv_heads: int,
                   min_len: int = 1, scales: Sequence[int] = (1,), fp32: bool = False,
                   short_bounds: tuple[Sequence[int], Sequence[int]] | None = None,
                   ) -> list[list[int]]:  # fmt: skip
    """Sequence lengths of the warm-up batches: at each count T on either side of every bound
    (and `min_len` and `max_tokens`), one sequence of T tokens (attention's prefill tile), T
    tokens in sequences of `min_len` (its decode tile), and past a partition of keys, one long
    sequence among short ones (the decode tile with split partitions). No sequence is shorter
    than `min_len` (a trainer scores sequences of at least 2 tokens). With `scales`, each
    bound b is also met at s * b and s * (b + 1) tokens, for a kernel that sees T / s rows.
    `fp32`: the forward runs in fp32 (attention's fp32 tile). `short_bounds`: (bounds of the
    batch of short sequences, bounds of the one with a long sequence among them), the counts
    where a choice of that batch changes (`request_bounds`); each is then made only on both
    sides of its own, the one-sequence batches still at every count: a kernel that sees the
    batch's T rows picks by T alone, which those cover (None: both at every count too)."""
    counts = {min_len, max_tokens}
    for b in token_bounds(top_k, q_per_kv, kv_heads, max_tokens, fp32):
        for s in scales:
            counts |= {s * b, s * (b + 1)}
    shorts, longs = (counts, counts) if short_bounds is None else (
        {min_len, *bs, *(b + 1 for b in bs)} for bs in short_bounds)  # fmt: skip
    long = attention.KV_PARTITION + 1
    batches = []
    for t in sorted(c for c in counts | shorts | longs if min_len <= c <= max_tokens):
        if t in counts:
            batches.append([t])
        if t in shorts and t >= 2 * min_len:
            batches.append(_short(t, min_len))
        if t in longs and t >= long + min_len:
            batches.append([long, *_short(t - long, min_len)])
    return batches


def _short(t: int, min_len: int) -> list[int]:
    """t tokens in sequences of `min_len`, the last one longer by the remainder."""
    q, r = divmod(t, min_len)
    return [min_len] * (q - 1) + [min_len + r]


@dataclass
class WarmUp:
    """What a warm-up ran and what it cost."""

    batches: int
    """Forwards run."""
    seconds: float
    """Wall time of the warm-up."""
    compile_seconds: float
    """Of which Triton's compiler."""
    compiles: int
    """Kernels compiled."""
    cache_hits: int
    """Kernels loaded from Triton's disk cache."""


def warm_up(forward: Callable[[list[int]], object], batches: Sequence[list[int]]) -> WarmUp:
    """Run `forward` on each batch of sequence lengths (the caller makes the tokens and syncs),
    counting Triton's compiles."""
    log, t0 = CompileLog(), time.perf_counter()
    with log.counting("warm-up"):
        for lengths in batches:
            forward(list(lengths))
    seconds, compiles, hits = log.total()
    return WarmUp(len(batches), time.perf_counter() - t0, seconds, compiles, hits)
