"""Group-normalised GRPO advantages, one scalar per sample.

The rewards come group after group: `group_size` samples of one prompt are contiguous. For a
sample i of group g with rewards r_1..r_n (n = group_size):

    mean_g = (r_1 + ... + r_n) / n                       (math.fsum: exactly rounded)
    std_g  = sqrt(sum_j (r_j - mean_g)^2 / (n - 1))      (sample std, Bessel-corrected)
    A_i    = (r_i - mean_g) / (std_g + eps)              (normalize_std=True)
    A_i    = r_i - mean_g                                (normalize_std=False, Dr. GRPO)

The sample std is what `torch.std` (and so miles and verl) computes. A group whose rewards are
all equal, including every group of one sample, gets advantages of exactly 0.0: such a group
carries no learning signal, and computing r - mean in floating point could leave a residue
(three rewards of 0.1 have a mean of 0.10000000000000002).

Everything is Python float (IEEE float64) arithmetic in a fixed order, so the same rewards
give the same advantages bit for bit on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> list[float]:
    """Advantages of `rewards` (groups of `group_size` contiguous samples), in the same order."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be an int >= 1, got {group_size!r}")
    if len(rewards) % group_size != 0:
        raise ValueError(
            f"group_advantages: {len(rewards)} rewards do not split into groups of "
            f"{group_size} (len(rewards) % group_size = {len(rewards) % group_size})"
        )
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"group_advantages: eps must be finite and >= 0, got {eps!r}")
    values = [float(r) for r in rewards]
    bad = [(i, r) for i, r in enumerate(values) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"group_advantages: rewards must be finite; (index, value): {bad[:4]}")

    out: list[float] = []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        if min(group) == max(group):
            out.extend([0.0] * group_size)
            continue
        mean = math.fsum(group) / group_size
        centred = [r - mean for r in group]
        if not normalize_std:
            out.extend(centred)
            continue
        # group_size >= 2 here: a group of one is always all-equal.
        std = math.sqrt(math.fsum(c * c for c in centred) / (group_size - 1))
        out.extend(c / (std + eps) for c in centred)
    return out
