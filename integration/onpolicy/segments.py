"""The run's K segments: how many equal segments each row-parallel matmul's K is cut into.

A matmul's K is cut into S equal segments (`kernels.rules.k_segments`), and a rank of a
`tp`-way row-parallel cut computes S / tp of them. Every process that computes the matmul (the
trainer's ranks, the engines' ranks, the reference model) must cut it into the same S, or the
sums differ. The contract computes S once from the run config (`onpolicy.contract.k_segments`);
the launcher hands it to every process in ONPOLICY_K_SEGMENTS (the plan's training and rollout
environment); the exact layers read it here, parsed once (`current`, `per_rank`).

Nothing configured, a process takes S = its own TP (one segment per shard): what a standalone
engine or trainer computes at its own layout, and at TP 1 (the reference model) the unsplit K.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from typing import Literal

ENV = "ONPOLICY_K_SEGMENTS"
"""The environment variable that carries the run's `KSegments` to every process."""

Matmul = Literal["attention", "experts"]
"""A row-parallel matmul of Qwen3-MoE, named as `KSegments` names its field."""


def _power_of_2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class KSegments:
    """S of each row-parallel matmul: the largest TP that cuts its K on either side of the run
    and divides K, 1 where no side splits it (so always 1 or a power-of-2 TP)."""

    attention: int = 1
    """S of the attention output projection: K = heads x head_dim, cut by training.tp and
    rollout.tp."""
    experts: int = 1
    """S of the experts' down projection: K = moe_intermediate_size, cut by training.etp and
    the rollout MoE TP (rollout.tp / rollout.ep)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not _power_of_2(v):
                raise ValueError(
                    f"KSegments: {f.name} = {v!r}; S is 1 or a power-of-2 TP "
                    "(kernels.rules.k_segments)"
                )

    def env_value(self) -> str:
        """The value of ONPOLICY_K_SEGMENTS, e.g. 'attention=2,experts=1'."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> KSegments:
        """The inverse of `env_value`; every field must be named once."""
        names = [f.name for f in fields(cls)]
        form = ",".join(f"{n}=S" for n in names)
        values: dict[str, int] = {}
        for item in text.split(","):
            name, sep, value = item.strip().partition("=")
            if not sep or name not in names or name in values or not value.strip().isdigit():
                raise ValueError(
                    f"{ENV}={text!r}: {item.strip()!r} is not one of {form} (each once, S a "
                    "power of 2); the contract writes it (onpolicy.contract.k_segments)"
                )
            values[name] = int(value)
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"{ENV}={text!r}: {', '.join(missing)} missing; expected {form}")
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{ENV}={text!r}: {e}") from None


@functools.cache
def current() -> KSegments | None:
    """This process's K segments: ONPOLICY_K_SEGMENTS, parsed on the first call and kept for
    the life of the process; None when it is not set."""
    text = os.environ.get(ENV)
    return None if text is None else KSegments.parse(text)


def per_rank(matmul: Matmul, tp: int) -> int:
    """The segments one rank of a `tp`-way row-parallel cut of `matmul` passes to
    `kernels.linear_partial`: S / tp of the configured S, 1 when none is configured (S = tp).
    At tp 1 it is the whole S (the reference model, an unsplit K)."""
    s = current()
    if s is None:
        return 1
    total = getattr(s, matmul)
    if tp < 1 or total % tp:
        raise ValueError(
            f"{ENV}: {matmul} K is cut into S = {total} segments, which {tp} ranks cannot share "
            "(each must hold S / tp whole segments, kernels.rules.row_parallel_exact); start "
            "this process with the run's ONPOLICY_K_SEGMENTS (the contract's plan)"
        )
    return total // tp
