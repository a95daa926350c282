"""Group filtering (DAPO's dynamic sampling): a group whose rewards are all equal has advantages
of exactly 0 and teaches nothing, so with `grpo.filter_groups` the step drops such groups and
samples more prompts from the data stream, batch after batch (at most
`grpo.filter_max_batches` batches of prompts_per_step prompts in one step), until it holds
prompts_per_step groups with signal. When the batches run out first, the step tops the batch up
with the earliest dropped groups (zero advantage), so every step trains on the same number of
samples. Logged per step: `filter/dropped_groups` (groups sampled and dropped),
`filter/batches` (prompt batches sampled), `filter/topped_up` (dropped groups trained on to
fill the batch).
"""

from __future__ import annotations


def has_signal(group: list[float]) -> bool:
    """Whether a group's rewards differ (exact float comparison, as the advantages use)."""
    return any(r != group[0] for r in group[1:])


def select_groups(rewards: list[float], n: int, want: int) -> tuple[list[int], list[int]]:
    """The groups of `rewards` (groups of `n`, contiguous) kept, the first `want` with signal,
    and those dropped before the batch was full; group indices in order."""
    if n < 1 or len(rewards) % n:
        raise ValueError(f"select_groups: {len(rewards)} rewards in groups of {n}")
    kept: list[int] = []
    dropped: list[int] = []
    for g in range(len(rewards) // n):
        if len(kept) >= want:
            break
        (kept if has_signal(rewards[g * n : (g + 1) * n]) else dropped).append(g)
    return kept, dropped


def fill(kept: list[int], dropped: list[int], want: int) -> list[int]:
    """The step's groups: the kept ones, topped up with the earliest dropped ones to `want`,
    in sampling order."""
    return sorted(kept[:want] + dropped[: max(want - len(kept), 0)])
