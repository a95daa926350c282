"""Per-layer captures of one sequence's forward, the same named points in both engines.

`--bisect` reruns one sample through the rollout engine (`onpolicy.rollout.capture`, inside
SGLang's scheduler processes) and the trainer (`onpolicy.train.capture`, on every Megatron rank)
and records, at each point below, every token's value keyed by (layer, op, absolute position).
`onpolicy.grpo.bisect` then walks the points in `ORDER` and names the first that differs.

The points, in the order a token meets them (`layer` -1 is before the decoder, `num_layers`
after it):
- layer -1: `embedding` (the token's embedding row);
- per decoder layer: `input_layernorm` (its output), `attention` (core attention output, all
  heads, before o_proj), `o_proj` (after its TP sum, rounded to the model dtype),
  `post_attention_layernorm`, `router.ids` (int32 [k]), `router.weights` (fp32 [k]), `moe` (the
  combined expert output, after its EP/TP sums);
- layer num_layers: `final_norm`, `logits` (fp32, full vocab; the rollout computes them only
  where it samples: the prompt's last position and every decode step), `logprob` (fp32 log p of
  the next token at temperature T, at the position that predicts it).

Each rank writes the rows it holds (`Recorder`, one file a rank); a row is a position and the
value's features flattened, and a point sharded over the feature dim (attention heads, vocab)
records its shard index. `load` merges every rank's file of one side into full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

PER_LAYER = ("input_layernorm", "attention", "o_proj", "post_attention_layernorm", "router.ids",
             "router.weights", "moe")  # fmt: skip
"""The points of one decoder layer, in execution order."""
FIRST = ("embedding",)
"""The points before the decoder (layer -1)."""
LAST = ("final_norm", "logits", "logprob")
"""The points after it (layer num_layers)."""


def order(num_layers: int) -> list[tuple[int, str]]:
    """Every (layer, op) in the order a token meets them."""
    return ([(-1, op) for op in FIRST]
            + [(layer, op) for layer in range(num_layers) for op in PER_LAYER]
            + [(num_layers, op) for op in LAST])  # fmt: skip


@dataclass
class Recorder:
    """One rank's captured rows, written to `<dir>/<side>-rank<rank>.pt` by `save`."""

    rows: list[dict] = field(default_factory=list)
    """{"layer", "op", "positions" int64 [R], "values" [R, F], "shard" (index, count) | None}."""

    def add(self, layer: int, op: str, positions: torch.Tensor, values: torch.Tensor,
            shard: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Record `values` (first dim: one row per position) at `positions`; rows whose position
        is negative (padding) are dropped. `shard`: (index, count) of a feature-dim shard."""
        if op not in PER_LAYER + FIRST + LAST:
            raise ValueError(f"capture: unknown point {op!r}")
        positions = positions.reshape(-1).to(torch.int64).cpu().clone()  # engines reuse buffers
        values = values.detach().reshape(positions.shape[0], -1).cpu().clone()
        keep = positions >= 0
        if not bool(keep.all()):
            positions, values = positions[keep], values[keep]
        if positions.numel():
            self.rows.append({"layer": layer, "op": op, "positions": positions,
                              "values": values, "shard": shard})  # fmt: skip

    def save(self, out_dir: str | Path, side: str, rank: int) -> Path:
        path = Path(out_dir) / f"{side}-rank{rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.rows, path)
        return path


@dataclass(frozen=True)
class Point:
    """One (layer, op)'s full values, one row per captured position, positions ascending."""

    positions: torch.Tensor
    """int64 [P]."""
    values: torch.Tensor
    """[P, F], every shard joined."""


def load(out_dir: str | Path, side: str) -> dict[tuple[int, str], Point]:
    """Every rank file of `side` in `out_dir`, merged: (layer, op) -> Point.

    A position held by several ranks (replicated rows) keeps the first file's row; feature
    shards are joined in shard order. ValueError when no file exists or a shard is missing.
    """
    files = sorted(Path(out_dir).glob(f"{side}-rank*.pt"))
    if not files:
        raise ValueError(f"capture: no {side}-rank*.pt files in {out_dir}")
    rows: dict[tuple[int, str], dict[int, dict[int, torch.Tensor]]] = {}
    counts: dict[tuple[int, str], int] = {}
    for f in files:
        for rec in torch.load(f, weights_only=True):  # never code from a capture file
            key = (rec["layer"], rec["op"])
            index, count = rec["shard"] or (0, 1)
            if counts.setdefault(key, count) != count:
                raise ValueError(f"capture: {side} {key} recorded with {counts[key]} and "
                                 f"{count} shards")  # fmt: skip
            per_pos = rows.setdefault(key, {})
            for p, v in zip(rec["positions"].tolist(), rec["values"], strict=True):
                per_pos.setdefault(p, {}).setdefault(index, v)
    points = {}
    for key, per_pos in rows.items():
        positions = sorted(per_pos)
        missing = [p for p in positions if len(per_pos[p]) != counts[key]]
        if missing:
            raise ValueError(f"capture: {side} {key} position {missing[0]} holds "
                             f"{len(per_pos[missing[0]])} of {counts[key]} shards")  # fmt: skip
        values = torch.stack([torch.cat([per_pos[p][i] for i in range(counts[key])])
                              for p in positions])  # fmt: skip
        points[key] = Point(torch.tensor(positions, dtype=torch.int64), values)
    return points
