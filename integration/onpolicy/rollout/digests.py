"""Whole log-prob rows, by digest: what the exact sampler saw at every position it sampled.

With ONPOLICY_ROW_DIGESTS set to a folder in an engine's environment, the exact sampler
(`rollout.sampler`) writes, for every row it samples, `bits.row_digests` of the whole fp32
log-prob row `kernels.log_softmax(kernels.scale_logits(logits, T))` (every vocabulary entry),
keyed by the request's sampling seed and the step (tokens generated before it). Each TP rank
writes its own file. The trainer computes the same function on its own logits
(`train.logprobs(..., digests=True)`), so equal digests mean the two whole distributions have
the same bits, not only the sampled token's entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ENV = "ONPOLICY_ROW_DIGESTS"
"""The folder the sampler writes its digests to; unset: none are written."""


def folder() -> Path | None:
    """This process's digest folder, or None when digests are off."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def record(out: Path, rank: int, seeds: list[int], steps: list[int], digests: torch.Tensor) -> None:
    """Append one line per sampled row to this rank's file (one write per batch)."""
    lines = "".join(
        json.dumps({"seed": int(s), "step": int(t), "digest": int(d)}) + "\n"
        for s, t, d in zip(seeds, steps, digests.tolist(), strict=True)
    )
    with (out / f"rank{rank}.jsonl").open("a") as f:
        f.write(lines)


def read(out: Path) -> dict[tuple[int, int], int]:
    """(sampling seed, step) -> digest from every rank's file; ranks must agree."""
    found: dict[tuple[int, int], int] = {}
    files = sorted(out.glob("rank*.jsonl"))
    if not files:
        raise RuntimeError(f"row digests: no rank*.jsonl in {out} (was {ENV} set in the engine?)")
    for f in files:
        for line in f.read_text().splitlines():
            row = json.loads(line)
            key, d = (row["seed"], row["step"]), row["digest"]
            if found.setdefault(key, d) != d:
                raise RuntimeError(
                    f"row digests: seed {key[0]} step {key[1]} has digests {found[key]} and {d} "
                    f"({f.name}): the ranks sampled different rows"
                )
    return found


def sample_digests(found: dict[tuple[int, int], int], seed: int, n: int) -> list[int]:
    """The digests of one sample's n generated tokens (steps 0..n-1) by its sampling seed."""
    missing = [t for t in range(n) if (seed, t) not in found]
    if missing:
        raise RuntimeError(f"row digests: seed {seed} has no digest for steps {missing[:8]}")
    return [found[seed, t] for t in range(n)]
