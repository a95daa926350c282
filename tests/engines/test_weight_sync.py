"""Megatron -> SGLang weight sync at PP1 EP2, PP2 EP1 (TP2 ETP2 SP) and PP2 EP2, checked twice.

Two exact engines (TP2 EP2 and TP1) start once from checkpoint A and keep running; each trainer
layout is one torchrun job (workers/weight_sync.py) holding another checkpoint, which connects
to both engines, syncs in small buckets, and checks the result two ways: every box every
engine rank holds has the trainer's digest, and the engines' sampled log-probs equal the
trainer's `onpolicy.train.logprobs` bit for bit. Controls in the same harness: the check before
the sync, and after one tensor was changed behind the trainer's back, must fail and name it;
the log-probs compared before the sync must differ.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
from onpolicy.contract.config import load_config
from onpolicy.contract.rules import validate
from onpolicy.layout import ParallelLayout
from onpolicy.models import write_tiny_checkpoint
from onpolicy.models.hf_layout import hf_tensor_shapes
from onpolicy.models.tiny import TINY
from onpolicy.rollout.host import KEY_ENV, EngineHost
from onpolicy.weights import hf_names_by_rank

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "weight_sync.py"
ENGINES = {"engine0": (2, 2), "engine1": (1, 1)}
"""name -> (tp, ep) of the running engines."""
LAYOUTS = {
    "pp1-ep2": (ParallelLayout(world=2, ep=2), "tensor"),
    "pp2-ep1-tp2-etp2": (ParallelLayout(world=4, tp=2, pp=2, etp=2, sp=True), "distributed"),
    "pp2-ep2": (ParallelLayout(world=4, pp=2, ep=2), "distributed"),
}
"""name -> (trainer layout, transport)."""
BUCKET_BYTES = 1 << 16
"""Small enough that a sync of the tiny model takes many buckets (its largest tensors, the
embedding and the head at 128 KiB each, travel alone)."""


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_pairs_are_exact_by_the_contract(name, engine):
    layout, _ = LAYOUTS[name]
    tp, ep = ENGINES[engine]
    over = {"training.world": layout.world, "training.tp": layout.tp, "training.pp": layout.pp,
            "training.ep": layout.ep, "training.etp": layout.etp, "training.sp": layout.sp,
            "rollout.tp": tp, "rollout.ep": ep, "rollout.engines": 1,
            "rollout.colocate": False}  # fmt: skip
    validate(load_config(REPO / "configs" / "tiny-cpu.toml", over))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, compile_cache):
    work = tmp_path_factory.mktemp("weight-sync")
    start = write_tiny_checkpoint(work / "ckpt-a", seed=0)
    key = secrets.token_hex(16)
    # sleep_on_idle, as the run's engines have it: an idle scheduler waits on its sockets
    # instead of spinning, which would take the cores from the trainer jobs between syncs.
    hosts = [EngineHost.start(n, start, work / "hosts", tp=tp, ep=ep, key=key, cache=compile_cache,
                              engine_args={"sleep_on_idle": True})
             for n, (tp, ep) in ENGINES.items()]  # fmt: skip
    try:
        for h in hosts:
            h.wait()
        yield work, hosts
    finally:
        for h in hosts:
            h.stop()


@pytest.fixture(scope="module")
def results(engines, torchrun):
    work, hosts = engines
    spec = json.dumps([{"name": h.name, "address_file": str(h.address_file)} for h in hosts])
    out = {}
    for seed, (name, (layout, transport)) in enumerate(LAYOUTS.items(), start=1):
        ckpt = write_tiny_checkpoint(work / f"ckpt-{name}", seed=seed)
        flags = [f"--{k}={v}" for k, v in (("tp", layout.tp), ("pp", layout.pp),
                                            ("ep", layout.ep), ("etp", layout.etp))]  # fmt: skip
        torchrun(WORKER, layout.world, "--ckpt", str(ckpt), "--engines", spec, *flags,
                 *(["--sp"] if layout.sp else []), "--transport", transport,
                 "--bucket-bytes", str(BUCKET_BYTES), "--out", str(work / f"{name}.json"),
                 timeout=900, env={KEY_ENV: hosts[0].key})  # fmt: skip
        out[name] = json.loads((work / f"{name}.json").read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sync_is_checked_by_digests_and_log_probs(results, name):
    r = results[name]
    n_tensors = len(hf_tensor_shapes(TINY))
    # Control: before the sync the engines hold checkpoint A (or the previous layout's weights).
    assert not r["before"]["ok"] and "differs from the trainer's" in r["before"]["message"]
    assert r["sync"]["tensors"] == n_tensors and r["sync"]["buckets"] > 5, r["sync"]
    assert r["after"] == {"ok": True, "tensors": n_tensors, "boxes": r["after"]["boxes"]}
    # engine0 (TP2) holds every tensor in one or two boxes, engine1 (TP1) in one.
    assert r["after"]["boxes"] >= 2 * n_tensors, r["after"]
    # Control: the same comparison before the sync sees the other weights.
    before = r["rollouts_before"][0]
    assert before["compared"] == 3 * 8 and before["equal"] < before["compared"], before
    for roll in r["rollouts"]:
        assert roll["compared"] == 3 * 8 and roll["equal"] == roll["compared"], roll
        assert roll["versions"] == ["v1"], roll
    assert [x["engine"] for x in r["rollouts"]] == list(ENGINES)
    # Control: a tensor changed on engine 0 alone is named, with the engine.
    msg = r["tampered"]["message"]
    assert not r["tampered"]["ok"]
    assert f"{r['victim']['engine']} rank" in msg and r["victim"]["tensor"] in msg, msg
    assert "engine1" not in msg, msg
    assert r["resynced"]["ok"], r["resynced"]


def test_names_at_pp1_ep2():
    """Each EP rank sends its own experts under their global ids; the layers keep theirs."""
    cfg = _small()
    names = hf_names_by_rank(cfg, ParallelLayout(world=2, ep=2))
    assert _experts(names) == {
        0: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.0.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.0.mlp.experts.1.down_proj.weight"),
            ("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.1.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.1.mlp.experts.1.down_proj.weight")],
        1: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.0.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.0.mlp.experts.3.down_proj.weight"),
            ("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.1.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.1.mlp.experts.3.down_proj.weight")],
    }  # fmt: skip
    assert _layers(names) == {0: {"decoder.layers.0": "model.layers.0",
                                  "decoder.layers.1": "model.layers.1"}}  # fmt: skip


def test_names_at_pp2_ep1():
    """Stage 1's local layer 0 is global layer 1; its experts keep their ids (EP 1)."""
    cfg = _small()
    names = hf_names_by_rank(cfg, ParallelLayout(world=2, pp=2))
    assert _experts(names) == {
        0: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.0.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.0.mlp.experts.1.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
             "model.layers.0.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
             "model.layers.0.mlp.experts.3.down_proj.weight")],
        1: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.1.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.1.mlp.experts.1.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
             "model.layers.1.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
             "model.layers.1.mlp.experts.3.down_proj.weight")],
    }  # fmt: skip
    assert _layers(names) == {0: {"decoder.layers.0": "model.layers.0"},
                              1: {"decoder.layers.0": "model.layers.1"}}  # fmt: skip
    assert names[0][0] == ("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    assert names[1][-1] == ("output_layer.weight", "lm_head.weight")


def test_names_at_pp2_ep2():
    """Both offsets at once: rank 3 (stage 1, EP rank 1) sends layer 1's experts 2 and 3."""
    cfg = _small()
    names = hf_names_by_rank(cfg, ParallelLayout(world=4, pp=2, ep=2))
    assert _experts(names) == {
        0: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.0.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.0.mlp.experts.1.down_proj.weight")],
        1: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.0.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.0.mlp.experts.3.down_proj.weight")],
        2: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.1.mlp.experts.0.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.1.mlp.experts.1.down_proj.weight")],
        3: [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
             "model.layers.1.mlp.experts.2.down_proj.weight"),
            ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "model.layers.1.mlp.experts.3.down_proj.weight")],
    }  # fmt: skip
    assert _layers(names) == {0: {"decoder.layers.0": "model.layers.0"},
                              2: {"decoder.layers.0": "model.layers.1"}}  # fmt: skip
    # fc1 splits into gate and up under the same global ids.
    assert ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight") in names[3]  # fmt: skip


def test_every_hf_tensor_is_sent_once_at_every_layout():
    cfg = _small()
    for layout in (ParallelLayout(world=2, ep=2), ParallelLayout(world=2, pp=2),
                   ParallelLayout(world=4, pp=2, ep=2),
                   ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)):  # fmt: skip
        sent = [n for rows in hf_names_by_rank(cfg, layout).values() for r in rows for n in r[1:]]
        assert sorted(sent) == sorted(hf_tensor_shapes(cfg)), layout


def _small():
    from onpolicy.models.tiny import tiny

    return tiny(num_hidden_layers=2, num_experts=4)


def _experts(names):
    return {r: [(x[0], x[1]) for x in rows if x[0].endswith("linear_fc2.weight")]
            for r, rows in names.items() if any("experts" in x[0] for x in rows)}  # fmt: skip


def _layers(names):
    out = {}
    for r, rows in names.items():
        for x in rows:
            if x[0].endswith("input_layernorm.weight"):
                out.setdefault(r, {})[x[0].rsplit(".", 2)[0]] = x[1].rsplit(".", 2)[0]
    return out


def test_an_engine_that_dies_is_named_with_its_log(tmp_path):
    """A host whose engine cannot start is reported by name with its log, not waited on."""
    from onpolicy.rollout.host import EngineError

    host = EngineHost.start("broken", tmp_path / "no-such-checkpoint", tmp_path / "hosts")
    try:
        with pytest.raises(EngineError, match=r"broken: the engine host exited with \d+ while "
                           r"starting; see .*broken\.log"):  # fmt: skip
            host.wait(timeout=600)
    finally:
        host.stop()
    assert host.proc.poll() is not None
