"""Routing mismatch: the rollout's routed expert ids against the trainer's, per token and layer.

Under the contract both engines route every token with the same `kernels.moe_route` on the same
bits, so the count is 0; it is a cheap cross-check that points at the MoE router when the
log-probs differ. A row is one (position, layer); its k ids are compared as a set (sorted),
since the exact combine sums a token's slots in expert-id order and the slot order carries
nothing. The rollout has rows for positions 0..len-2 (the last token is sampled, never run);
the trainer has all len positions, of which the last is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def routing_mismatch(rollout: Sequence[torch.Tensor],
                     trainer: Sequence[torch.Tensor]) -> tuple[int, int]:  # fmt: skip
    """(rows whose k ids differ, rows compared) over all samples: rollout[i] int [len_i - 1,
    layers, top_k] against trainer[i][: len_i - 1] (trainer[i]: [len_i, layers, top_k]).

    ValueError, naming the sample and both shapes, when the lists or shapes do not match.
    """
    if len(rollout) != len(trainer):
        raise ValueError(
            f"routing_mismatch: {len(rollout)} rollout samples vs {len(trainer)} trainer samples"
        )
    differ = compared = 0
    for i, (r, t) in enumerate(zip(rollout, trainer, strict=True)):
        if r.dim() != 3 or t.shape != (r.shape[0] + 1, *r.shape[1:]):
            raise ValueError(
                f"routing_mismatch: sample {i}: rollout routes {tuple(r.shape)} vs trainer "
                f"{tuple(t.shape)}; want [len-1, layers, top_k] vs [len, layers, top_k]"
            )
        a = r.to(torch.int64).sort(dim=-1).values
        b = t[: r.shape[0]].to(torch.int64).sort(dim=-1).values
        differ += int((a != b).any(dim=-1).sum())
        compared += a.shape[0] * a.shape[1]
    return differ, compared
