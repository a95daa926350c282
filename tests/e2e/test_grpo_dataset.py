"""`onpolicy e2e` on real prompts: configs/tiny-cpu-math.toml (the generated arithmetic set in
JSONL, eval on its Parquet file, the tiny tokenizer's chat template, math-verify rewards on the
decoded responses), on the real engines: Ray, 4 Megatron ranks (TP2 EP2 SP) and one exact SGLang
engine (TP2 EP2); the config's own layouts (8 ranks, two engines) run the band task in
test_grpo.py, and the data path does not depend on them.

Two processes: `first` is asked for 4 steps, saves a checkpoint every 2 and gets Ctrl-C (SIGINT)
once step 2's checkpoint is in place: it tears down with exit 130 and leaves no process.
`resumed` continues it with `--resume` to step 4. Checked: abs_diff and kl 0.0 at every step;
every reward is the math rule on the response decoded from its ids; the eval metrics at steps 2
and 4 only; and the prompts of every step, including the resumed steps 3 and 4, are the data
stream's for that step, which is what an uninterrupted run takes (the stream is a function of
the config and the step: tests/unit/test_grpo_data.py).
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
from cli_run import ABS_DIFF, KL, Run, assert_on_policy, stopped_on_error

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu-math.toml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # its runs' fixture included


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compile_cache) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("e2e-math")
    with stopped_on_error():
        sets = [x for kv in ("run.checkpoint_every=2", "run.wandb_mode=disabled",
                             "training.world=4", "training.pp=1", "rollout.engines=1")
                for x in ("--set", kv)]  # fmt: skip
        first = Run(CONFIG, root / "math", *sets, steps=4, log="first", cache=compile_cache)
        if first.until(lambda: first.latest() == 2):
            first.proc.send_signal(signal.SIGINT)
        first.wait()
        resumed = Run(CONFIG, root / "math", "--resume", *sets, steps=4, log="resumed",
                      cache=compile_cache)  # fmt: skip
        resumed.wait()
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


def test_ctrl_c_tears_down(runs):
    first = runs["first"]
    assert first.code == 130, first.text[-5000:]
    assert "interrupted; tearing down" in first.text, first.text[-3000:]
    assert [r["step"] for r in first.metrics()][:2] == [1, 2], first.text[-3000:]
    first.check_clean()


def test_math_run_is_on_policy_and_resumes(runs):
    first, resumed = runs["first"], runs["resumed"]
    assert resumed.code == 0, resumed.text[-5000:]
    assert "resumed at step 2" in resumed.text, resumed.text[-3000:]
    assert "data: 64 of 64 training prompts (0 longer than data.max_prompt_tokens" in first.text
    rows = resumed.metrics()
    assert_on_policy(rows, 4, resumed.text)
    for r in rows:
        assert r[ABS_DIFF] == 0.0 and r[KL] == 0.0, r
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
    for i, (sets, rule) in enumerate(cases):
        out = tmp_path / f"run{i}"  # a refused run leaves its config behind: a fresh --out each
        args = ["--config", str(CONFIG), "--out", str(out), "--set", "run.wandb_mode=disabled"]
        args += [x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")]
        assert main(args) == 2, sets
        err = capsys.readouterr().err
        assert rule in err, (sets, err)
        assert "engines up" not in err and not (out / "actors.json").exists(), err
