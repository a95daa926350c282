"""`--bisect`: the first layer and op whose outputs differ between the two engines on one sample.

The rollout engine (`EngineService.capture_generate`) and the trainer
(`onpolicy.train.capture.capture_logprobs`) each capture the points of `onpolicy.capture` into a
folder. `compare` walks the points in the order a token meets them and compares, at every
position both captured, the bits of the two values (integer views, `onpolicy.bits`);
`first_divergence` is the first point with a differing position.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from onpolicy.bits import as_bits, hex_bits
from onpolicy.capture import load, order


@dataclass(frozen=True, slots=True)
class PointResult:
    """One point's comparison."""

    layer: int
    """Decoder layer; -1 before the decoder, num_layers after it."""
    op: str
    """The point's name (`onpolicy.capture`)."""
    compared: int
    """Positions both sides captured."""
    differ: int
    """Of those, positions with any differing bits (or another dtype or width)."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first point where the rollout and the trainer disagree."""

    layer: int
    """Decoder layer; -1 before the decoder (the embedding), num_layers after it."""
    op: str
    """The point (`onpolicy.capture`), e.g. "attention"."""
    position: int
    """The first differing absolute token position."""
    element: int
    """The first differing feature index at that position."""
    rollout_hex: str
    """That element's bits on the rollout side, e.g. 0x3f80."""
    trainer_hex: str
    """And on the trainer side."""
    rollout_value: float
    trainer_value: float
    elements_differ: int
    """Differing elements at this point, over every compared position."""
    elements: int
    """Elements compared at this point."""
    positions_differ: int
    """Positions with any differing element."""
    positions: int
    """Positions compared at this point."""
    note: str = ""
    """Set when the two sides' dtypes or widths differ (then every position counts)."""

    def describe(self) -> str:
        where = {-1: "before the decoder"}.get(self.layer, f"layer {self.layer}")
        text = (f"first divergence: {where} {self.op} at position {self.position} element "
                f"{self.element}: rollout {self.rollout_value!r} ({self.rollout_hex}) vs trainer "
                f"{self.trainer_value!r} ({self.trainer_hex}); {self.positions_differ} of "
                f"{self.positions} positions and {self.elements_differ} of {self.elements} "
                f"elements differ")  # fmt: skip
        return text + (f" ({self.note})" if self.note else "")


def _manifests(rollout_dir: Path, trainer_dir: Path) -> int:
    r = json.loads((rollout_dir / "rollout-manifest.json").read_text())
    t = json.loads((trainer_dir / "trainer-manifest.json").read_text())
    if r["tokens"] != t["tokens"]:
        raise ValueError(
            f"bisect: the captures ran different sequences ({len(r['tokens'])} rollout tokens, "
            f"{len(t['tokens'])} trainer tokens); capture the trainer on the rollout's tokens"
        )
    if r["num_layers"] != t["num_layers"] or r["temperature"] != t["temperature"]:
        raise ValueError(f"bisect: the captures differ in layers or temperature: {r} vs {t}")
    return int(r["num_layers"])


def _diff(layer: int, op: str, rp, tp) -> tuple[PointResult, Divergence | None]:
    common, ri, ti = _common(rp.positions, tp.positions)
    a, b = rp.values[ri], tp.values[ti]
    n = len(common)
    if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
        note = f"rollout {a.dtype} x{a.shape[1]}, trainer {b.dtype} x{b.shape[1]}"
        width = min(a.shape[1], b.shape[1])
        first = Divergence(layer, op, int(common[0]), 0, hex_bits(a[0, 0]), hex_bits(b[0, 0]),
                           float(a[0, 0]), float(b[0, 0]), n * width, n * width, n, n,
                           note) if n else None  # fmt: skip
        return PointResult(layer, op, n, n), first
    bad = as_bits(a) != as_bits(b)
    rows = bad.any(dim=1)
    if not bool(rows.any()):
        return PointResult(layer, op, n, 0), None
    r, e = (int(v) for v in torch.nonzero(bad)[0])
    div = Divergence(layer, op, int(common[r]), e, hex_bits(a[r, e]), hex_bits(b[r, e]),
                     float(a[r, e]), float(b[r, e]), int(bad.sum()), bad.numel(),
                     int(rows.sum()), n)  # fmt: skip
    return PointResult(layer, op, n, int(rows.sum())), div


def _common(p: torch.Tensor, q: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    where = {int(v): i for i, v in enumerate(q.tolist())}
    pairs = [(int(v), i, where[int(v)]) for i, v in enumerate(p.tolist()) if int(v) in where]
    return [x[0] for x in pairs], [x[1] for x in pairs], [x[2] for x in pairs]


def compare(rollout_dir: str | Path,
            trainer_dir: str | Path) -> tuple[list[PointResult], Divergence | None]:  # fmt: skip
    """Every point both sides captured, in order, and the first divergence (None if none).

    ValueError when the captures ran different sequences, or a point one side has is missing
    on the other (both engines capture the same points).
    """
    rdir, tdir = Path(rollout_dir), Path(trainer_dir)
    layers = _manifests(rdir, tdir)
    rollout, trainer = load(rdir, "rollout"), load(tdir, "trainer")
    missing = [k for k in order(layers) if (k in rollout) != (k in trainer)]
    if missing:
        sides = ["rollout" if k in rollout else "trainer" for k in missing]
        raise ValueError(f"bisect: point {missing[0]} captured by the {sides[0]} only")
    results, first = [], None
    for key in order(layers):
        if key not in rollout:
            continue
        res, div = _diff(*key, rollout[key], trainer[key])
        results.append(res)
        first = first or div
    return results, first


def first_divergence(rollout_dir: str | Path, trainer_dir: str | Path) -> Divergence | None:
    """The first (layer, op) in a token's order whose values differ at some position both
    captured, with the first such position and element; None when every point is equal."""
    return compare(rollout_dir, trainer_dir)[1]
