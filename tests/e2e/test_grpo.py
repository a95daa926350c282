"""`onpolicy e2e` on configs/tiny-cpu.toml: real Ray, 8 Megatron ranks (TP2 PP2 EP2 SP), two
exact SGLang engines (TP2 EP2), every step asserting train == rollout bit for bit.

Each run is the CLI in its own process (cli_run.Run): its listeners are recorded while it runs,
and no process of it may be left after it exits. The runs:
- `base`: 2 steps, a checkpoint after each; every step's abs_diff and kl are 0.0 in the JSONL;
- `stock`: the rollout on SGLang's stock path (the assertion's negative control) at the
  smallest layouts (2 ranks TP2 SP, one engine TP1), prompts of 1 to 300 tokens: the run stops
  at step 1 naming the first differing token, and `--bisect` names the layer and op;
- `learning`: colocated engines on 4 trainer ranks with the tensor transport, 8 steps: the
  reward rises.
Ctrl-C's teardown and the resume of a run killed between publishing a save and moving `latest`
(the unpublished save set aside, the step made again bit for bit) are tested on the dataset
config (test_grpo_dataset.py), a killed trainer rank with the other faults
(test_grpo_faults.py); a resume's bits at this config's layout (TP2 PP2 EP2 SP, distributed
optimizer) in tests/engines/test_checkpoint_dist.py.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from cli_run import (
    ABS_DIFF,
    Run,
    assert_on_policy,
    sets,
    stopped_on_error,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.toml"
# The stock control at the prompt lengths the exact path is tested at, 1 to a few hundred tokens
# (stock bf16 SDPA takes another kernel from 64 tokens on).
STOCK_PROMPTS = ("--set", "task.prompt_min_tokens=1", "--set", "task.prompt_max_tokens=300")
SMALL = sets("training.world=2", "training.tp=2", "training.pp=1", "training.ep=1",
             "rollout.engines=1", "rollout.tp=1", "rollout.ep=1")  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]  # its runs' fixture included


def check_versions(rows: list[dict]) -> None:
    """Step N trains weight version N on a rollout of the weights step N - 1 made."""
    for r in rows:
        assert r["weight_version"] == r["step"], r
        assert r["rollout/weight_version"] == ("default" if r["step"] == 1 else
                                               str(r["step"] - 1)), r  # fmt: skip


# --- the runs ---------------------------------------------------------------------------------
def _run(out: Path, *args: str, steps: int = 2, log: str = "", cache: Path) -> Run:
    return Run(CONFIG, out, *args, steps=steps, log=log, cache=cache)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compile_cache) -> dict[str, Run]:
    """`base`, shared by the tests below."""
    root = tmp_path_factory.mktemp("e2e")
    with stopped_on_error():
        base = _run(root / "base", "--set", "run.checkpoint_every=1", cache=compile_cache)
        base.wait()
        return {"base": base}


def test_tiny_e2e_is_on_policy_at_every_step(runs):
    base = runs["base"]
    assert base.code == 0, base.text[-4000:]
    rows = base.metrics()
    assert_on_policy(rows, 2, base.text)
    check_versions(rows)
    assert all(r["grad_norm"] > 0 and r["reward/std"] > 0 for r in rows), rows
    assert base.latest() == 2, base.text[-3000:]
    text = base.text
    assert "step 1/2 | abs_diff 0.0 | kl 0.0" in text and "step 2/2 | abs_diff 0.0" in text, text
    assert "abs_diff" in text.split("step 2/2")[-1] and "done in" in text, text[-2000:]
    base.check_clean()


def test_nothing_listens_beyond_loopback(runs):
    run = runs["base"]
    names = {n for _, _, n in run.listeners}
    # The run's listeners were seen: Ray's head and the run's own processes.
    assert {"gcs_server", "raylet"} <= names, run.listeners
    assert any(n.startswith("ray::TrainerActor") for n in names), run.listeners
    wild = {x for x in run.listeners
            if not ipaddress.ip_address(x[0].removeprefix("::ffff:")).is_loopback}  # fmt: skip
    assert not wild, f"listening beyond loopback: {sorted(wild)}"


def test_the_stock_rollout_breaks_the_assertion_at_step_1(tmp_path, compile_cache):
    """The negative control: SGLang's own CPU path samples; the trainer's exact log-probs
    differ, and the run stops at step 1 naming the first differing token in hex; `--bisect`
    reruns that sample on both engines with captures and names the first op that differs."""
    run = _run(tmp_path / "stock", "--bisect", *SMALL, *sets("grpo.rollout_path=stock",
               "grpo.routing_check=false"), *STOCK_PROMPTS, cache=compile_cache)  # fmt: skip
    assert run.wait() == 1, run.text[-4000:]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [1] and rows[0][ABS_DIFF] > 0, rows
    v = json.loads((run.out / "violation.json").read_text())
    first = v["first_mismatch"]
    assert first["rollout_hex"] != first["trainer_hex"], first
    assert f"token id {first['token']}" in run.text and first["rollout_hex"] in run.text
    assert "true-on-policy broken" in run.text
    bisect = [ln for ln in run.text.splitlines() if ln.startswith("bisect: ")]
    assert len(bisect) == 1 and f"sample {first['sample']}: first divergence: layer " in bisect[0]
    assert " position " in bisect[0] and "0x" in bisect[0], bisect
    assert (run.out / "bisect" / f"step1-sample{first['sample']}" / "trainer").is_dir()
    run.check_clean()


def test_the_reward_rises(tmp_path, compile_cache):
    """Colocated this time: 2 engines on the trainer's 4 ranks (TP2 EP2 SP), weights through
    shared-memory handles (the tensor transport). The band task with one band (answer with ids
    below 200), 64 samples a step at lr 3e-2: the random policy's 0.2 climbs from step 3
    (measured: 0.20 0.21 0.27 0.28 0.41 0.55 0.80 0.93)."""
    steps = 8
    overrides = sets("training.world=4", "training.pp=1", "rollout.colocate=true",
                     "sync.transport=tensor", "task.num_bands=1", "optimizer.lr=3e-2",
                     "grpo.prompts_per_step=8", "grpo.samples_per_prompt=8")  # fmt: skip
    run = _run(tmp_path / "learning", *overrides, steps=steps, cache=compile_cache)
    assert run.wait(1800) == 0, run.text[-4000:]
    rows = run.metrics()
    assert_on_policy(rows, steps, run.text)
    check_versions(rows)
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.15, [round(r["reward/mean"], 3) for r in rows]
    run.check_clean()
