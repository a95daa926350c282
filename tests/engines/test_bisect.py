"""`--bisect`: per-layer captures of one sample in both engines, and the first point that differs.

Two SGLang engines (TP2 EP2): the exact one and the stock one (`exact=False`, SGLang's own ops,
the negative control). Each generates one sample through `EngineService.capture_generate`
(every TP rank's points captured in the scheduler processes, during the normal prefill and
decode). The engines are then stopped, and one torchrun job (world 8: Megatron TP2 PP2 EP2 with
SP) captures the same points while `logprobs()` scores each sample's sequence
(`onpolicy.train.capture.capture_logprobs`). The engines and the job are the routing test's
too (exact_and_stock.py). `onpolicy.grpo.bisect` compares the points as
integer views: the exact rollout equals the trainer at every point and position; the stock
rollout diverges inside layer 0, before the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from exact_and_stock import BISECT_NEW, BISECT_PROMPT
from onpolicy.capture import PER_LAYER, Recorder, order
from onpolicy.grpo.bisect import compare, first_divergence
from onpolicy.models.tiny import TINY

PROMPT, NEW = BISECT_PROMPT, BISECT_NEW
LAYERS = TINY.num_hidden_layers


@pytest.fixture(scope="module")
def captures(exact_and_stock):
    """{"exact"|"stock": (rollout capture dir, trainer capture dir)}."""
    return exact_and_stock["bisect"]


@pytest.mark.slow
def test_exact_engines_agree_at_every_point(captures):
    results, first = compare(*captures["exact"])
    n = len(PROMPT) + NEW
    assert [(r.layer, r.op) for r in results] == order(LAYERS)
    for r in results:
        # Hidden points: every position that ran (0..n-2); logits and log-probs: where the
        # rollout sampled (the prompt's last position and each decode step).
        want = NEW if r.op in ("logits", "logprob") else n - 1
        assert (r.compared, r.differ) == (want, 0), r
    assert first is None and first_divergence(*captures["exact"]) is None
    print(f"exact TP2 EP2 vs Megatron TP2 PP2 EP2 SP: {len(results)} points, "
          f"{sum(r.compared for r in results)} (point, position) rows, all equal")  # fmt: skip


@pytest.mark.slow
def test_stock_engine_diverges_in_layer_0(captures):
    results, first = compare(*captures["stock"])
    assert len(results) == len(order(LAYERS))
    assert first is not None
    print(first.describe())
    assert first.layer == 0 and first.op in PER_LAYER, first
    assert first.rollout_hex != first.trainer_hex and first.positions_differ > 0
    # Everything before it was compared and equal (the embedding is a copy on both paths).
    before = results[: [(r.layer, r.op) for r in results].index((first.layer, first.op))]
    assert before and all(r.compared > 0 and r.differ == 0 for r in before), before
    assert f"layer 0 {first.op} at position {first.position}" in first.describe()


def _side(path: Path, side: str, tokens: list[int], values: dict, temperature: float = 1.0):
    rec = Recorder()
    for (layer, op), v in values.items():
        rec.add(layer, op, torch.arange(v.shape[0]), v)
    rec.save(path, side, 0)
    manifest = {"tokens": tokens, "num_layers": 1, "temperature": temperature}
    (path / f"{side}-manifest.json").write_text(json.dumps(manifest))


def test_first_divergence_names_the_first_point_in_token_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {k: torch.randn(5, 3, generator=g).to(torch.bfloat16) for k in order(1)}
    values[0, "router.ids"] = torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int32)
    _side(tmp_path / "r", "rollout", [1, 2, 3, 4, 5, 6], values)
    changed = dict(values)
    for key, pos, el in (((0, "moe"), 3, 1), ((0, "attention"), 4, 2), ((1, "logits"), 0, 0)):
        v = changed[key].clone()
        v.view(torch.int16)[pos, el] += 1  # one ulp
        changed[key] = v
    _side(tmp_path / "t", "trainer", [1, 2, 3, 4, 5, 6], changed)
    d = first_divergence(tmp_path / "r", tmp_path / "t")
    assert (d.layer, d.op, d.position, d.element) == (0, "attention", 4, 2)
    assert (d.positions_differ, d.positions, d.elements_differ, d.elements) == (1, 5, 1, 15)
    assert d.rollout_hex != d.trainer_hex and d.rollout_hex.startswith("0x")
    results, _ = compare(tmp_path / "r", tmp_path / "t")
    assert [r.differ for r in results if r.differ] == [1, 1, 1]
    _side(tmp_path / "same", "trainer", [1, 2, 3, 4, 5, 6], values)
    assert first_divergence(tmp_path / "r", tmp_path / "same") is None
    _side(tmp_path / "u", "trainer", [1, 2, 3, 4, 5, 7], values)
    with pytest.raises(ValueError, match="different sequences"):
        first_divergence(tmp_path / "r", tmp_path / "u")
    del values[0, "moe"]
    _side(tmp_path / "w", "trainer", [1, 2, 3, 4, 5, 6], values)
    with pytest.raises(ValueError, match=r"point \(0, 'moe'\) captured by the rollout only"):
        first_divergence(tmp_path / "r", tmp_path / "w")
