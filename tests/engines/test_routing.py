"""Routing cross-check: the rollout's routed expert ids equal the trainer's, per token and layer.

One exact SGLang engine (TP2 EP2, `return_routed_experts=True`) samples a few prompts through
`EngineService.generate` (`rollout.engine.sample` with `return_routed_experts`); SGLang's own
routed-experts capturer returns the ids `onpolicy.rollout.moe` fed it. One torchrun job (world
8: Megatron TP2 PP2 EP2 with SP, so the ids come from SP shards, two pipeline stages, two EP
ranks and two DP replicas) scores the same sequences with `logprobs(..., routes=True)`.
`onpolicy.grpo.routing.routing_mismatch` must count 0 differing (position, layer) rows.

Negative control in the same harness: the stock engine (`exact=False`: SGLang's router, its
capturer fed by SGLang's TopK, its attention and combine) samples the same prompts greedily (its
sampler ignores the seed; greedy keeps the control deterministic), and the same torchrun job
scores those sequences too; the ids must differ on some rows. The engines run while sampling
only and are stopped before the trainer job, which then has the two cores to itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from onpolicy.bits import n_differ
from onpolicy.grpo.routing import routing_mismatch
from onpolicy.models.tiny import TINY
from onpolicy.rollout import routing
from onpolicy.rollout.host import EngineHost

WORKER = Path(__file__).parent / "workers" / "routing.py"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [500, 600, 700, 800, 900, 17], [42, 43]]
NEW = 10
TEMPERATURE = 0.8
LAYERS, TOP_K = TINY.num_hidden_layers, TINY.num_experts_per_tok


def _request(temperature: float) -> dict:
    return {"prompts": PROMPTS, "new_tokens": NEW, "temperature": temperature, "seed": 5,
            "return_routed_experts": True}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, torchrun, tmp_path_factory):
    """{"exact"|"stock": (samples, trainer result on their sequences)}."""
    work = tmp_path_factory.mktemp("routing")
    extra = {"return_routed_experts": True}
    hosts = {"exact": EngineHost.start("exact", tiny_checkpoint, work, tp=2, ep=2,
                                       engine_args=extra),
             "stock": EngineHost.start("stock", tiny_checkpoint, work, tp=2, ep=2, exact=False,
                                       engine_args=extra)}  # fmt: skip
    samples = {}
    try:
        for name, temperature in (("exact", TEMPERATURE), ("stock", 0.0)):
            client = hosts[name].connect()
            samples[name] = client.call("generate", request=_request(temperature))
            client.close()
    finally:
        for h in hosts.values():
            h.stop()
    seqs = [s["prompt"] + s["output_ids"] for name in ("exact", "stock") for s in samples[name]]
    (work / "sequences.json").write_text(json.dumps(seqs))
    torchrun(WORKER, 8, "--ckpt", str(tiny_checkpoint), "--sequences", str(work / "sequences.json"),
             "--temperature", str(TEMPERATURE), "--out", str(work / "trainer.pt"), "--tp", "2",
             "--pp", "2", "--ep", "2", "--sp", "--mb-tokens", "32", timeout=900)  # fmt: skip
    got = torch.load(work / "trainer.pt")
    n = len(PROMPTS)
    return {
        "exact": (samples["exact"], got["logprobs"][:n], got["routes"][:n]),
        "stock": (samples["stock"], got["logprobs"][n:], got["routes"][n:]),
    }


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
