"""Weight updates on a real SGLang Engine: after each, the rollout is the new weights' reference.

One engine per layout and dtype (workers/sglang_weights.py; one worker process per TP and EP,
its engines one after the other) starts on the seed-0 tiny checkpoint, then takes a rejected
update outside a begin/end session, an `update_weights_from_tensor` session to the seed-1
weights and an `update_weights_from_distributed` session (a gloo trainer process broadcasting)
to the seed-2 weights, with a rollout after each.
Every rollout's log-probs must equal, bit for bit, `Qwen3MoeReference.score` of the same tokens
under the weights that phase should hold; the negative controls compare each rollout against
the weights it should NOT hold and assert the comparison breaks, and the same harness on
SGLang's stock CPU path must not match the reference.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from onpolicy.bits import bitwise_equal, mismatch_report, n_differ
from onpolicy.rollout.engine import engine_env

WORKER = Path(__file__).parent / "workers" / "sglang_weights.py"
PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [500, 600, 700, 800, 900]]
NEW_TOKENS = 8
TEMPERATURE = 1.0
LAYOUTS = {
    "tp1-bf16": (1, 1, "bfloat16", False),
    "tp1-fp32": (1, 1, "float32", False),
    "tp2-ep2-bf16": (2, 2, "bfloat16", False),
    "tp2-ep2-fp32": (2, 2, "float32", False),
    # The negative control: the same harness on SGLang's stock CPU path.
    "tp1-bf16-stock": (1, 1, "bfloat16", True),
}
# Which checkpoint seed each phase's rollout must reproduce, and the one it must not.
EXPECT = {
    "initial": (0, 1),
    "outside_session": (0, 1),
    "tensor": (1, 0),
    "distributed": (2, 1),
}
VERSIONS = {"initial": "default", "outside_session": "default", "tensor": "v1",
            "distributed": "v2"}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[int, Path]:
    from onpolicy.models import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("weights-ckpt")
    return {0: tiny_checkpoint, **{s: write_tiny_checkpoint(root / f"seed{s}", seed=s)
                                   for s in (1, 2)}}  # fmt: skip


@pytest.fixture(scope="module")
def engine_runs(checkpoints, tmp_path_factory, compile_cache):
    """(tp, ep) -> name -> phases: one worker process per TP and EP, its engines (each layout of
    that TP and EP) one after the other; each worker runs once, when first asked for."""

    @functools.cache
    def get(tp: int, ep: int) -> dict[str, list[dict]]:
        mine = {n: x for n, x in LAYOUTS.items() if x[:2] == (tp, ep)}
        layouts = [{"name": n, "dtype": x[2], "stock": x[3]} for n, x in mine.items()]
        tmp = tmp_path_factory.mktemp(f"weights-tp{tp}-ep{ep}")
        out = tmp / "result.json"
        cmd = [sys.executable, str(WORKER), "engine", "--ckpt", str(checkpoints[0]),
               "--tensor-ckpt", str(checkpoints[1]), "--distributed-ckpt", str(checkpoints[2]),
               "--out", str(out), "--tp", str(tp), "--ep", str(ep),
               "--layouts", json.dumps(layouts), "--new-tokens", str(NEW_TOKENS),
               "--temperature", str(TEMPERATURE), "--prompts", json.dumps(PROMPTS)]  # fmt: skip
        env = engine_env(tp, compile_cache, base=os.environ)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            pytest.fail(f"engines tp={tp} ep={ep} exited {p.returncode}\n{p.stderr[-8000:]}")
        runs = json.loads(out.read_text())["runs"]
        assert list(runs) == [x["name"] for x in layouts], list(runs)
        return runs

    return get


@pytest.fixture(params=list(LAYOUTS))
def engine_run(request, engine_runs):
    tp, ep, dtype, stock = LAYOUTS[request.param]
    return request.param, dtype, stock, engine_runs(tp, ep)[request.param]


def reference_logprobs(ckpt: Path, dtype: str, samples: list[dict]) -> list[torch.Tensor]:
    """The reference model's log-probs of each sample's generated tokens."""
    from onpolicy.models.reference import Qwen3MoeReference

    model = Qwen3MoeReference.from_pretrained(ckpt, getattr(torch, dtype))
    seqs = [s["prompt"] + s["output_ids"] for s in samples]
    scores = model.score(seqs, TEMPERATURE)
    return [lp[len(s["prompt"]) - 1 :] for lp, s in zip(scores, samples, strict=True)]


def rollout_logprobs(samples: list[dict]) -> list[torch.Tensor]:
    # The engine's fp32 values widened to Python floats narrow back without rounding.
    return [torch.tensor(s["logprobs"], dtype=torch.float32) for s in samples]


@pytest.mark.slow
def test_updates_report_success_and_version(engine_run):
    name, _dtype, _stock, phases = engine_run
    by = {p["phase"]: p for p in phases}
    assert list(by) == list(EXPECT), f"{name}: phases {list(by)}"
    rejected = by["outside_session"]
    assert rejected["success"] is False and "begin_weight_update" in rejected["message"], rejected
    for phase in ("tensor", "distributed"):
        failed = [r for r in by[phase]["results"] if r[0] is not True]
        assert not failed, f"{name}: {phase} session steps failed: {failed}"
    trainer = by["distributed"]
    assert trainer["trainer_rc"] == 0, (
        f"{name}: trainer process exited {trainer['trainer_rc']}:\n{trainer['trainer_log']}"
    )
    for phase, want in VERSIONS.items():
        got = {s["weight_version"] for s in by[phase]["samples"]}
        assert got == {want}, f"{name}: {phase}: weight_version {got}, want {want!r}"


@pytest.mark.slow
def test_rollout_after_update_is_the_new_weights(engine_run, checkpoints):
    name, dtype, stock, phases = engine_run
    report = []
    for p in phases:
        good, bad = EXPECT[p["phase"]]
        got = rollout_logprobs(p["samples"])
        want = reference_logprobs(checkpoints[good], dtype, p["samples"])
        other = reference_logprobs(checkpoints[bad], dtype, p["samples"])
        got_all, want_all, other_all = torch.cat(got), torch.cat(want), torch.cat(other)
        equal = got_all.numel() - n_differ(got_all, want_all)
        report.append(f"{p['phase']}: {equal}/{got_all.numel()} equal to seed {good}")
        if stock:  # the stock ops' rounding must show: the comparison can fail
            assert not bitwise_equal(got_all, want_all), f"{name}: {p['phase']} matched"
            continue
        assert bitwise_equal(got_all, want_all), (
            f"{name}: {p['phase']} rollout vs seed-{good} reference: "
            f"{mismatch_report(got_all, want_all)}"
        )
        # Negative control: the same comparison against the weights this phase must not hold.
        assert n_differ(got_all, other_all) > 0.5 * got_all.numel(), (
            f"{name}: {p['phase']} rollout also matches the seed-{bad} reference"
        )
    print(f"{name}: " + "; ".join(report))
