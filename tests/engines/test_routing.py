"""Routing cross-check: the rollout's routed expert ids equal the trainer's, per token and layer.

One exact SGLang engine (TP2 EP2, `return_routed_experts=True`) samples a few prompts through
`EngineService.generate` (`rollout.engine.sample` with `return_routed_experts`); SGLang's own
routed-experts capturer returns the ids `onpolicy.rollout.moe` fed it. One torchrun job (world
8: Megatron TP2 PP2 EP2 with SP, so the ids come from SP shards, two pipeline stages, two EP
ranks and two DP replicas) scores the same sequences with `logprobs(..., routes=True)`. The
engines and the job are the `--bisect` test's too (exact_and_stock.py).
`onpolicy.grpo.routing.routing_mismatch` must count 0 differing (position, layer) rows.

Negative control in the same harness: the stock engine (`exact=False`: SGLang's router, its
capturer fed by SGLang's TopK, its attention and combine) samples the same prompts greedily (its
sampler ignores the seed; greedy keeps the control deterministic), and the same torchrun job
scores those sequences too; the ids must differ on some rows.
"""

from __future__ import annotations

import pytest
import torch
from exact_and_stock import ROUTING_NEW, ROUTING_PROMPTS
from onpolicy.bits import n_differ
from onpolicy.grpo.routing import routing_mismatch
from onpolicy.models.tiny import TINY
from onpolicy.rollout import routing

PROMPTS, NEW = ROUTING_PROMPTS, ROUTING_NEW
LAYERS, TOP_K = TINY.num_hidden_layers, TINY.num_experts_per_tok


@pytest.fixture(scope="module")
def runs(exact_and_stock):
    """{"exact"|"stock": (samples, trainer log-probs, trainer routes on their sequences)}."""
    return exact_and_stock["routing"]


@pytest.mark.slow
def test_exact_rollout_routes_equal_the_trainers(runs):
    samples, logprobs, trainer = runs["exact"]
    rollout = [routing.decode(s["routed_experts"]) for s in samples]
    for s, r, t in zip(samples, rollout, trainer, strict=True):
        n = len(s["prompt"]) + NEW
        assert r.dtype == t.dtype == torch.int32
        assert r.shape == (n - 1, LAYERS, TOP_K) and t.shape == (n, LAYERS, TOP_K)
        assert int(t.min()) >= 0 and int(t.max()) < TINY.num_experts
    differ, compared = routing_mismatch(rollout, trainer)
    want = sum(len(p) + NEW - 1 for p in PROMPTS) * LAYERS
    print(f"exact TP2 EP2 rollout vs Megatron TP2 PP2 EP2 SP: {differ} of {compared} "
          f"(position, layer) rows differ")  # fmt: skip
    assert (differ, compared) == (0, want)
    # The same sequences: the trainer's log-probs of the sampled tokens are the rollout's bits.
    for s, lp in zip(samples, logprobs, strict=True):
        mine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert n_differ(mine, lp[len(s["prompt"]) - 1 :]) == 0


@pytest.mark.slow
def test_stock_rollout_routes_differ(runs):
    samples, _, trainer = runs["stock"]
    rollout = [routing.decode(s["routed_experts"]) for s in samples]
    differ, compared = routing_mismatch(rollout, trainer)
    print(f"stock TP2 EP2 rollout (greedy) vs Megatron exact: {differ} of {compared} rows differ")
    assert compared == sum(len(p) + NEW - 1 for p in PROMPTS) * LAYERS
    assert 0 < differ < compared, (differ, compared)


def test_routed_experts_reads_sglangs_field():
    ids = torch.arange(5 * LAYERS * TOP_K, dtype=torch.int32).view(5, LAYERS, TOP_K) % 8
    b64 = routing.encode(ids)["int32_b64"]
    meta = {"routed_experts": b64, "prompt_tokens": 3, "completion_tokens": 3}
    assert torch.equal(routing.routed_experts(meta, LAYERS, TOP_K), ids)
    assert torch.equal(routing.decode(routing.encode(ids)), ids)
    with pytest.raises(ValueError, match="no 'routed_experts'"):
        routing.routed_experts({"prompt_tokens": 3}, LAYERS, TOP_K)
    with pytest.raises(ValueError, match="not whole rows"):
        routing.routed_experts({"routed_experts": b64}, LAYERS, TOP_K + 1)
    with pytest.raises(ValueError, match="want 6"):
        routing.routed_experts({**meta, "completion_tokens": 4}, LAYERS, TOP_K)


def test_routing_mismatch_counts_rows_and_refuses_shapes():
    t = torch.randint(0, 8, (6, LAYERS, TOP_K), dtype=torch.int32)
    r = t[:5].flip(-1).clone()  # the same sets in another slot order: equal
    assert routing_mismatch([r], [t]) == (0, 5 * LAYERS)
    r[2, 1] = (r[2, 1] + 1) % 8
    r[4, 0, 0] = (r[4, 0, 0] + 3) % 8
    assert routing_mismatch([r, r], [t, t]) == (4, 10 * LAYERS)
    with pytest.raises(ValueError, match=r"sample 1: rollout routes \(6, 4, 2\) vs trainer"):
        routing_mismatch([r, t], [t, t])
    with pytest.raises(ValueError, match="1 rollout samples vs 2"):
        routing_mismatch([r], [t, t])
