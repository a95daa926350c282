"""`onpolicy e2e` on real prompts: configs/tiny-cpu-math.toml (the generated arithmetic set in
JSONL, eval on its Parquet file, the tiny tokenizer's chat template, rewards on the decoded
responses), on the real engines at the smallest layouts: Ray, 2 Megatron ranks (TP2 SP) and one
exact SGLang engine (TP1); the config's own layouts (8 ranks, two engines TP2 EP2) run the band
task in test_grpo.py, and the data path does not depend on them.

Three processes:
- `math`: 3 steps of the config as it is, math-verify rewards, eval at step 2 (eval.every) and
  at the end. A random tiny model answers no question right, so it does not learn. It runs the
  trainers' compile warm-up on the CPU (`grpo.compile_warmup = "always"`), and after it the
  weight sync, whose verify shows the warm-up left the weights as loaded.
- `first` and `resumed`: the same data with a custom reward by path
  (`reward_fixtures:has_digit`, a dict reward a random model earns now and then) and group
  filtering on, so most groups are dropped and refilled from the stream and the kept ones
  change the weights. `first` is asked for 4 steps, saves every step and gets Ctrl-C (SIGINT)
  once step 3's checkpoint is in place: it tears down with exit 130 and leaves no process.
  `latest` is then set back to step 2, what a run killed between publishing step 3's folder
  and moving `latest` leaves. `resumed` continues it with `--resume`: it sets the unpublished
  save aside, and from step 2 (the stream at the position step 2 saved) makes step 3 again,
  bit for bit the step `first` made (metrics and weights), then step 4. `resumed` runs the
  warm-up and `first` does not: the warm-up changes no bit of the step after it.

Checked: abs_diff and kl 0.0 at every step; every reward is its function on the response decoded
from its ids; the eval metrics where due; every step's prompts are the stream's at that step's
position (what an uninterrupted run takes: the stream is a function of the config and the
position, tests/unit/test_grpo_data.py); the filtered steps kept exactly the groups the rule
keeps, and trained with a gradient exactly when a kept group had signal.
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
from cli_run import (
    Run,
    assert_on_policy,
    assert_same_weights,
    sets,
    steady,
    stopped_on_error,
    weights,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu-math.toml"
FIXTURES = REPO / "tests" / "unit"  # reward_fixtures
# Micro-batches of 512 tokens (a sequence here has at most 272) keep the CPU warm-up's largest
# batches small.
SMALL = ("run.wandb_mode=disabled", "training.world=2", "training.tp=2", "training.pp=1",
         "training.ep=1", "rollout.engines=1", "rollout.tp=1", "rollout.ep=1",
         "grpo.micro_batch_tokens=512")  # fmt: skip
FILTERED = ("run.checkpoint_every=1", 'reward.name="custom"',
            'reward.path="reward_fixtures:has_digit"', "grpo.filter_groups=true",
            "grpo.filter_max_batches=3")  # fmt: skip
WARM = ('grpo.compile_warmup="always"',)
N, WANT, TOKENS = 4, 4, 16  # the config's samples_per_prompt, prompts_per_step, max_new_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # its runs' fixture included


@pytest.fixture(scope="module")
def runs(tmp_path_factory, compile_cache) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("e2e-math")
    with stopped_on_error():
        math = Run(CONFIG, root / "math", *sets(*SMALL, *WARM), steps=3, log="math",
                   cache=compile_cache)  # fmt: skip
        math.wait()
        filtered = sets(*SMALL, *FILTERED)
        first = Run(CONFIG, root / "filtered", *filtered, steps=4, log="first",
                    cache=compile_cache, path=(FIXTURES,))  # fmt: skip
        if first.until(lambda: first.latest() == 3):
            first.proc.send_signal(signal.SIGINT)
        first.wait()
        first_rows = first.metrics()  # the resume rewrites the rows after its start
        # Step 3's save published, `latest` not moved: what a run killed between the two leaves.
        (first.out / "checkpoints" / "latest").write_text("2\n")
        resumed = Run(CONFIG, root / "filtered", "--resume", *filtered, *sets(*WARM), steps=4,
                      log="resumed", cache=compile_cache, path=(FIXTURES,))  # fmt: skip
        resumed.wait()
        return {"math": math, "first": first, "first_rows": first_rows, "resumed": resumed}


@pytest.fixture(scope="module")
def task(runs):
    """The runs' dataset task, made again here from the config and its checkpoint's tokenizer."""
    from onpolicy.grpo.config import load_e2e_config
    from onpolicy.grpo.tasks import TaskContext, make_task

    e = load_e2e_config(CONFIG)
    (ckpt,) = runs["math"].out.glob("tiny-seed*")
    context = TaskContext(checkpoint=ckpt, data=e.data, reward=e.reward, seed=e.grpo.seed)
    t = make_task(e.task, e.cfg.shape.vocab_size, e.cfg.shape.eos_token_id, context)
    yield t
    t.close()


def _warmed_up(run: Run) -> int:
    """How many compile warm-ups the run's log reports."""
    return sum("trainer compile warm-up: " in ln for ln in run.text.splitlines())


def _check_finish(s: dict, task) -> None:
    stop = s["output_ids"][-1] in task.stop_token_ids()
    assert (s["finish"] == "length") == (not stop and len(s["output_ids"]) == TOKENS), s


def test_math_run_is_on_policy(runs):
    run = runs["math"]
    assert run.code == 0, run.text[-5000:]
    assert "data: 64 of 64 training prompts (0 longer than data.max_prompt_tokens" in run.text
    rows = run.metrics()
    assert_on_policy(rows, 3, run.text)
    assert _warmed_up(run) == 1, run.text[-3000:]
    # The sync after the warm-up kept the engines' own version: step 1 samples the start weights.
    assert rows[0]["rollout/weight_version"] == "default", rows[0]
    for r in rows:
        assert r["data/position"] == WANT * r["step"], r
        assert 0.0 <= r["response/truncated_frac"] <= 1.0 and "reward/answered" in r, r
        assert "filter/batches" not in r, r
    evals = [r["step"] for r in rows if "eval/reward_mean" in r]
    assert evals == [2, 3], rows  # eval.every = 2, and at the end
    for r in rows:
        if r["step"] in evals:
            assert r["eval/k"] == 2 and r["eval/prompts"] == 8 and r["eval/samples"] == 16, r
            assert 0.0 <= r["eval/pass@1"] <= r["eval/pass@k"] <= 1.0, r
            assert 0.0 <= r["eval/reward_mean"] <= 1.0 and "eval/answered" in r, r
    assert json.loads((run.out / "data.json").read_text())["stop_token_ids"] == [999]
    head = [ln for ln in run.text.splitlines() if ln.split()[:2] == ["step", "abs_diff"]]
    assert len(head) == 1 and "eval" in head[0].split() and "pass@k" in head[0].split(), head
    run.check_clean()
    print(f"\nwall: math {run.wall_s:.1f} s")


def test_math_rewards_are_the_rule_on_the_decoded_text(runs, task):
    from onpolicy.grpo.rewards import math_reward

    run = runs["math"]
    assert run.code == 0, run.text[-3000:]
    seen = 0
    for name in ("step_0000001", "step_0000002", "step_0000003", "eval_0000002",
                 "eval_0000003"):  # fmt: skip
        for s in run.samples(name):
            assert s["response"] == task.decode(s["output_ids"]), s
            got = math_reward(s["prompt_text"], s["response"], s["label"], {})
            assert s["reward"] == got["score"] and s["reward_metrics"] == {
                "answered": got["answered"]
            }, s
            _check_finish(s, task)
            seen += 1
    assert seen == 3 * 16 + 2 * 16
    rows = {r["step"]: r for r in run.metrics()}
    for step in range(1, 4):
        rewards = [s["reward"] for s in run.samples(f"step_{step:07d}")]
        assert rows[step]["reward/mean"] == sum(rewards) / len(rewards)


def test_math_steps_take_the_data_streams_prompts(runs, task):
    """Step k took stream positions [4(k-1), 4k), 4 samples each; eval the eval file's first
    8 rows, 2 samples each, not trained on."""
    run = runs["math"]
    assert run.code == 0, run.text[-3000:]
    rows = []
    for step in range(1, 4):
        want = task.prompts(step, WANT, 0)
        got = run.samples(f"step_{step:07d}")
        assert [s["row"] for s in got] == [p.row for p in want for _ in range(N)], step
        assert [s["prompt_ids"] for s in got] == [p.ids for p in want for _ in range(N)], step
        assert [s["prompt_text"] for s in got] == [p.text for p in want for _ in range(N)]
        rows += [p.row for p in want]
    assert len(set(rows)) == 12  # one epoch: no row twice
    evals = run.samples("eval_0000003")
    assert [s["row"] for s in evals] == [r for r in range(8) for _ in range(2)]
    assert all(not s["trained"] for s in evals)


def test_ctrl_c_tears_down(runs):
    first = runs["first"]
    assert first.code == 130, first.text[-5000:]
    assert "interrupted; tearing down" in first.text, first.text[-3000:]
    assert [r["step"] for r in runs["first_rows"]][:3] == [1, 2, 3], first.text[-3000:]
    first.check_clean()


def test_filtered_run_is_on_policy_and_resumes(runs):
    first, resumed = runs["first"], runs["resumed"]
    assert resumed.code == 0, resumed.text[-5000:]
    assert "resumed at step 2" in resumed.text, resumed.text[-3000:]
    aside = [ln for ln in resumed.text.splitlines() if "is newer than `latest` (2)" in ln]
    assert len(aside) == 1 and "iter_0000003" in aside[0], resumed.text[-3000:]
    rows = resumed.metrics()
    assert_on_policy(rows, 4, resumed.text)
    assert (_warmed_up(first), _warmed_up(resumed)) == (0, 1), resumed.text[-3000:]
    # Step 3 made again from step 2's save, after a warm-up: the interrupted run's step 3, bit
    # for bit.
    assert [steady(r) for r in rows[:3]] == [steady(r) for r in runs["first_rows"][:3]]
    from onpolicy.checkpoint.torch_dist import global_tensors

    (unpublished,) = (resumed.out / "checkpoints").glob(".iter_0000003.aside-*")
    assert_same_weights(weights(resumed.out, 3), global_tensors(unpublished))
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [2, 4], rows
    assert all("eval/digits" in r for r in rows if "eval/reward_mean" in r), rows
    resumed.check_clean()
    print(f"\nwall: first {first.wall_s:.1f} s, resumed {resumed.wall_s:.1f} s")


def test_a_resume_with_nothing_left_to_run_is_refused_before_any_write(runs, monkeypatch,
                                                                      capsys):  # fmt: skip
    """--resume of the finished run (`latest` is step 4, the run is 4 steps): exit 2 naming
    the rule, before anything in the folder is written; the same for a resume to step 6 whose
    train file is missing."""
    from onpolicy.grpo.e2e import main
    from onpolicy.grpo.procs import RUN_ID_ENV

    run = runs["resumed"]
    assert run.code == 0 and run.latest() == 4, run.text[-3000:]
    from onpolicy.fsutil import LOCK_NAME

    def state() -> dict:  # every file but the lock (which takes the refused run's pid)
        return {p: p.stat().st_mtime_ns for p in run.out.rglob("*") if p.name != LOCK_NAME}

    before = state()
    monkeypatch.setenv(RUN_ID_ENV, uuid.uuid4().hex)
    args = ["--config", str(CONFIG), "--out", str(run.out), "--resume", "--steps", "4"]
    args += sets(*SMALL, *FILTERED)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "[resume_step]" in err and "`latest` is step 4 and the run is 4 steps" in err, err
    assert state() == before
    # A resume refused at its data (checked after the resume point, with the run's tokenizer)
    # keeps the run's config.json and everything else as they were.
    missing = REPO / "no-such-train-file.jsonl"
    args[args.index("--steps") + 1] = "6"
    assert main([*args, *sets(f"data.train_file={json.dumps(str(missing))}")]) == 2
    err = capsys.readouterr().err
    assert "[data_file]" in err and str(missing) in err, err
    assert state() == before


def test_filtered_steps_keep_the_groups_with_signal_and_continue_the_stream(runs, task):
    """Per step, from its samples file (every sample taken, trained or dropped): the samples in
    sampling order are `filter/batches` batches of the stream from where the previous step left
    it; the trained groups are exactly `fill(select_groups(...))`; the filter metrics count
    them; a gradient flowed exactly when a trained group had signal; and every reward is the
    custom function on the decoded response, its extra metric logged as reward/digits."""
    from onpolicy.grpo.filtering import fill, has_signal, select_groups
    from reward_fixtures import has_digit

    run = runs["resumed"]
    assert run.code == 0, run.text[-3000:]
    rows = {r["step"]: r for r in run.metrics()}
    position, learned = 0, []
    for step in range(1, 5):
        r = rows[step]
        taken = sorted(run.samples(f"step_{step:07d}"), key=lambda s: s["seed"])
        batches = r["filter/batches"]
        assert 1 <= batches <= 3 and len(taken) == batches * WANT * N, (step, r, len(taken))
        stream = task.prompts_at(position, batches * WANT)
        assert [s["row"] for s in taken] == [p.row for p in stream for _ in range(N)], step
        assert [s["prompt_ids"] for s in taken] == [p.ids for p in stream for _ in range(N)]
        position += batches * WANT
        assert r["data/position"] == position, (step, r)

        for s in taken:
            assert s["response"] == task.decode(s["output_ids"]), s
            got = has_digit(s["prompt_text"], s["response"], s["label"], {})
            assert s["reward"] == got["score"], s
            assert s["reward_metrics"] == {"digits": got["digits"]}, s
            _check_finish(s, task)
        rewards = [s["reward"] for s in taken]
        kept, dropped = select_groups(rewards, N, WANT)
        groups = fill(kept, dropped, WANT)
        assert [s["trained"] for s in taken] == [i // N in groups for i in range(len(taken))]
        assert len(kept) == WANT or batches == 3, (step, kept, batches)
        assert r["filter/dropped_groups"] == len(dropped), (step, r, dropped)
        assert r["filter/topped_up"] == WANT - min(len(kept), WANT), (step, r, kept)
        trained = [s for s in taken if s["trained"]]
        assert r["rollout/samples"] == len(trained) == WANT * N, r
        assert r["reward/mean"] == sum(s["reward"] for s in trained) / len(trained), r
        assert r["reward/digits"] == sum(s["reward_metrics"]["digits"] for s in trained) / len(
            trained
        ), r
        signal_ = any(has_signal(rewards[g * N : (g + 1) * N]) for g in groups)
        assert (r["grad_norm"] > 0.0) == signal_, (step, r["grad_norm"], groups)
        learned.append(signal_)
    # the fixture reward is rare (about one response in ten holds a digit): most groups are
    # dropped, and some step must have kept one with signal, or nothing here was exercised
    assert any(learned) and sum(rows[k]["filter/dropped_groups"] for k in rows) > 0, rows


def test_bad_input_exits_2_before_any_engine(tmp_path, monkeypatch, capsys):
    """Each refusal names its rule, starts nothing (no actors.json, no Ray) and leaves the fresh
    --out as it found it: the cases share one folder, so each next case would meet `[run_out]`
    if a refused run had left its config or seeded checkpoint behind."""
    from onpolicy.fsutil import LOCK_NAME
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
    out = tmp_path / "run"
    for overrides, rule in cases:
        args = ["--config", str(CONFIG), "--out", str(out), "--set", "run.wandb_mode=disabled"]
        args += sets(*(f"{k}={json.dumps(v)}" for k, v in overrides.items()))
        assert main(args) == 2, overrides
        err = capsys.readouterr().err
        assert rule in err, (overrides, err)
        assert "engines up" not in err, err
        left = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
        assert left == [], (overrides, left)
