"""`onpolicy e2e` on real prompts: configs/tiny-cpu-math.toml (the generated arithmetic set in
JSONL, eval on its Parquet file, the tiny tokenizer's chat template, math-verify rewards on the
decoded responses), on the real engines: Ray, 8 Megatron ranks (TP2 PP2 EP2 SP), two exact SGLang
engines (TP2 EP2).

Two processes: `first` runs steps 1-2 (evaluating after step 2, its last) and saves a
checkpoint; `resumed` continues it with `--resume` to step 4 (evaluating after step 4). Checked:
abs_diff and kl 0.0 at every step; every reward is the math rule on the response decoded from
its ids; the eval metrics at steps 2 and 4 only; and the prompts of every step, including the
resumed steps 3 and 4, are the data stream's for that step, which is what an uninterrupted run
takes (the stream is a function of the config and the step: tests/unit/test_grpo_data.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu-math.toml"
ABS_DIFF, KL = "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"

pytestmark = pytest.mark.slow


class Run:
    """One `onpolicy e2e --config tiny-cpu-math.toml` process."""

    def __init__(self, out: Path, *args: str, steps: int, log: str) -> None:
        self.out, self.run_id = out, uuid.uuid4().hex
        env = {**os.environ, "ONPOLICY_RUN_ID": self.run_id,
               "PYTHONPATH": os.pathsep.join([str(REPO / "integration"),
                                              os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, "-m", "onpolicy.cli", "e2e", "--config", str(CONFIG), "--out",
               str(out), "--steps", str(steps), "--set", "run.progress=false",
               "--set", "run.wandb_mode=disabled", *args]  # fmt: skip
        self.log = out.parent / f"{log}.log"
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with self.log.open("w") as f:
            self.code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       cwd=REPO, timeout=1200).returncode  # fmt: skip
        self.wall_s = time.perf_counter() - t0

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> list[dict]:
        from onpolicy.grpo.metrics import read_metrics

        return read_metrics(self.out / "metrics.jsonl")

    def samples(self, name: str) -> list[dict]:
        lines = (self.out / "samples" / f"{name}.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    def check_clean(self) -> None:
        from onpolicy.grpo.procs import run_processes

        left = run_processes(self.run_id)
        assert not left, f"processes of the run left after exit: {left}\n{self.text[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("e2e-math")
    first = Run(root / "math", "--set", "run.checkpoint_every=2", steps=2, log="first")
    resumed = Run(root / "math", "--resume", "--set", "run.checkpoint_every=2", steps=4,
                  log="resumed")  # fmt: skip
    return {"first": first, "resumed": resumed}


@pytest.fixture(scope="module")
def task(runs):
    """The run's dataset task, made again here from its config and its checkpoint's tokenizer."""
    from onpolicy.grpo.config import load_e2e_config
    from onpolicy.grpo.tasks import TaskContext, make_task

    e = load_e2e_config(CONFIG)
    (ckpt,) = runs["first"].out.glob("tiny-seed*")
    context = TaskContext(checkpoint=ckpt, data=e.data, reward=e.reward, seed=e.grpo.seed)
    t = make_task(e.task, e.cfg.shape.vocab_size, e.cfg.shape.eos_token_id, context)
    yield t
    t.close()


def test_math_run_is_on_policy_and_resumes(runs):
    first, resumed = runs["first"], runs["resumed"]
    assert first.code == 0, first.text[-5000:]
    assert resumed.code == 0, resumed.text[-5000:]
    assert "resumed at step 2" in resumed.text, resumed.text[-3000:]
    assert "data: 64 of 64 training prompts (0 longer than data.max_prompt_tokens" in first.text
    rows = resumed.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4], resumed.text[-3000:]
    for r in rows:
        assert r[ABS_DIFF] == 0.0 and r[KL] == 0.0, r
        assert r["train/logprob_equal_frac"] == 1.0 and r["train/tokens_compared"] > 0, r
        assert r["train/routing_mismatch"] == 0.0, r
        assert r["data/position"] == 4 * r["step"], r
        assert 0.0 <= r["response/truncated_frac"] <= 1.0 and "reward/answered" in r, r
    evals = [r["step"] for r in rows if "eval/reward_mean" in r]
    assert evals == [2, 4], rows
    for r in rows:
        if r["step"] in evals:
            assert r["eval/k"] == 2 and r["eval/prompts"] == 8 and r["eval/samples"] == 16, r
            assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0, r
            assert 0.0 <= r["eval/reward_mean"] <= 1.0 and "eval/answered" in r, r
    assert json.loads((first.out / "data.json").read_text())["stop_token_ids"] == [999]
    head = [ln for ln in resumed.text.splitlines() if ln.split()[:2] == ["step", "abs_diff"]]
    assert len(head) == 1 and "eval" in head[0].split() and "pass@k" in head[0].split(), head
    first.check_clean()
    resumed.check_clean()
    print(f"\nwall: first {first.wall_s:.1f} s, resumed {resumed.wall_s:.1f} s")


def test_rewards_are_the_math_rule_on_the_decoded_text(runs, task):
    from onpolicy.grpo.rewards import math_reward

    run = runs["resumed"]
    assert run.code == 0, run.text[-3000:]
    seen = 0
    for name in ("step_0000001", "step_0000002", "step_0000003", "step_0000004",
                 "eval_0000002", "eval_0000004"):  # fmt: skip
        for s in run.samples(name):
            assert s["response"] == task.decode(s["output_ids"]), s
            got = math_reward(s["prompt_text"], s["response"], s["label"], {})
            assert s["reward"] == got["score"] and s["reward_metrics"] == {
                "answered": got["answered"]
            }, s
            stop = s["output_ids"][-1] in task.stop_token_ids()
            assert (s["finish"] == "length") == (not stop and len(s["output_ids"]) == 16), s
            seen += 1
    assert seen == 4 * 16 + 2 * 16
    # the step's reward metrics are the samples'
    rows = {r["step"]: r for r in run.metrics()}
    for step in range(1, 5):
        rewards = [s["reward"] for s in run.samples(f"step_{step:07d}")]
        assert rows[step]["reward/mean"] == sum(rewards) / len(rewards)


def test_every_step_takes_the_data_streams_prompts(runs, task):
    """Steps 1-2 (first run) and 3-4 (after the stop and --resume) took the stream's prompts
    for their step, 4 prompts x 4 samples each: the prompts an uninterrupted run takes."""
    run = runs["resumed"]
    assert run.code == 0, run.text[-3000:]
    rows = []
    for step in range(1, 5):
        want = task.prompts(step, 4, 0)
        got = run.samples(f"step_{step:07d}")
        assert [s["row"] for s in got] == [p.row for p in want for _ in range(4)], step
        assert [s["prompt_ids"] for s in got] == [p.ids for p in want for _ in range(4)], step
        assert [s["prompt_text"] for s in got] == [p.text for p in want for _ in range(4)]
        rows += [p.row for p in want]
    assert len(set(rows)) == 16  # one epoch: no row twice
    evals = run.samples("eval_0000004")
    assert [s["row"] for s in evals] == [r for r in range(8) for _ in range(2)]
    assert all(not s["trained"] for s in evals)


def test_bad_input_exits_2_before_any_engine(tmp_path, monkeypatch, capsys):
    """Each refusal names its rule and starts nothing: no actors.json, no Ray."""
    from onpolicy.grpo.e2e import main
    from onpolicy.grpo.procs import RUN_ID_ENV

    monkeypatch.setenv(RUN_ID_ENV, uuid.uuid4().hex)  # the driver sets it: restored after
    nolabel = tmp_path / "nolabel.jsonl"
    nolabel.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    out = tmp_path / "run"
    cases = [
        ({"data.train_file": str(tmp_path / "missing.jsonl")}, "[data_file]"),
        ({"data.label_key": "answer"}, "[data_keys]"),
        ({"data.max_prompt_tokens": 3}, "[data_empty]"),
        ({"reward.name": "custom", "reward.path": "no_such_module_q:fn"}, "[reward_path]"),
        ({"reward.name": "custom", "reward.path": "reward_fixtures:two_args"},
         "[reward_signature]"),
        ({"data.eval_file": str(nolabel)}, "[data_keys]"),
        ({"grpo.prompts_per_step": 64, "grpo.steps": 2}, "[data_epochs]"),
    ]  # fmt: skip
    for sets, rule in cases:
        args = ["--config", str(CONFIG), "--out", str(out), "--set", "run.wandb_mode=disabled"]
        args += [x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")]
        assert main(args) == 2, sets
        err = capsys.readouterr().err
        assert rule in err, (sets, err)
        assert "engines up" not in err and not (out / "actors.json").exists(), err
