"""Metric sinks: the console line, the JSONL file (bit-exact floats, non-finite values, one write
and fsync per line, resume truncation, a killed write's fragment), wandb's mode and run id, the
progress bar, and one real offline wandb run."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import random
import struct
import sys
import time

import pytest
from onpolicy.grpo import metrics as M
from onpolicy.grpo.metrics import MetricsLogger, format_line, read_metrics

FULL = {
    M.ABS_DIFF: 0.0, M.KL: 0.0, M.REWARD_MEAN: 0.4123, M.REWARD_STD: 0.1178,
    M.RESPONSE_LEN: 12.34, M.GRAD_NORM: 0.037712, M.WEIGHT_VERSION: 3, M.TIME_ROLLOUT: 4.06,
    M.TIME_SCORE: 0.52, M.TIME_TRAIN: 2.01, M.TIME_SYNC: 0.29, "train/bitwise_equal_frac": 1.0,
    "note": "x",
}  # fmt: skip


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def logger(tmp_path, console=None, **kw) -> MetricsLogger:
    kw = {"run_name": "t", "config": {}, "total_steps": 10, "wandb_mode": "disabled",
          "progress": False, **kw}  # fmt: skip
    return MetricsLogger(tmp_path, console=console if console is not None else io.StringIO(), **kw)


def step_metrics(step: int) -> dict:
    return {M.REWARD_MEAN: step / 7, M.ABS_DIFF: 0.0, M.WEIGHT_VERSION: step - 1}


def test_format_line_full():
    assert format_line(3, 10, FULL) == (
        "step 3/10 | abs_diff 0.0 | kl 0.0 | reward 0.41±0.12 | len 12.3 | grad_norm 0.03771 | "
        "v3 | rollout 4.1s score 0.5s train 2.0s sync 0.3s"
    )


def test_format_line_missing_none_and_small_values():
    assert format_line(1, 2, {}) == "step 1/2"
    sparse = {M.KL: None, M.TIME_SYNC: 0.25, "other": 1.0}
    assert format_line(1, 2, sparse) == "step 1/2 | sync 0.2s"
    # a tiny non-zero mismatch must never print as zero; NaN shows as nan
    line = format_line(2, 2, {M.ABS_DIFF: 1e-9, M.KL: math.nan, M.REWARD_MEAN: 0.5})
    assert line == "step 2/2 | abs_diff 1e-09 | kl nan | reward 0.50"
    assert format_line(1, 1, {M.ABS_DIFF: -0.0}) == "step 1/1 | abs_diff 0.0"


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_jsonl_round_trip_is_bit_exact(tmp_path):
    rng = random.Random(0)
    floats = [rng.random() * 10.0 ** rng.randint(-300, 300) for _ in range(200)]
    floats += [0.1, 1 / 3, -0.0, 5e-324, sys.float_info.max, 2.0**-1074 * 3, 1e16 + 2]
    special = {"a_nan": math.nan, "b_inf": math.inf, "c_ninf": -math.inf}
    other = {"i": 7, "big": 2**62 + 1, "s": "ok", "none": None, "flag": True}
    with logger(tmp_path) as log:
        for i, x in enumerate(floats, start=1):
            log.log(i, {"x": x, **special, **other})
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(floats) + 1))
    assert [bits(r["x"]) for r in records] == [bits(x) for x in floats]
    for r in records:
        assert math.isnan(r["a_nan"]) and r["b_inf"] == math.inf and r["c_ninf"] == -math.inf
        assert {k: r[k] for k in other} == {"i": 7, "big": 2**62 + 1, "s": "ok", "none": None,
                                            "flag": 1}  # fmt: skip
    # the file is strict JSON: no NaN/Infinity literal anywhere
    for line in raw.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_each_line_is_one_write_and_an_fsync(tmp_path, monkeypatch):
    log = logger(tmp_path)
    writes, syncs, real_write, real_fsync = [], [], os.write, os.fsync
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append((fd, b)) or real_write(fd, b))
    monkeypatch.setattr(os, "fsync", lambda fd: syncs.append(fd) or real_fsync(fd))
    log.log(1, {"x": 1.5})
    log.log(2, {"x": 2.5})
    monkeypatch.undo()
    log.close()
    assert [b for _, b in writes] == [b'{"step": 1, "x": 1.5}\n', b'{"step": 2, "x": 2.5}\n']
    assert syncs == [writes[0][0], writes[1][0]]


def run(tmp_path, steps, start_step=0, metrics=step_metrics) -> bytes:
    with logger(tmp_path, start_step=start_step) as log:
        for s in steps:
            log.log(s, metrics(s))
    return (tmp_path / "metrics.jsonl").read_bytes()


def test_resume_equals_uninterrupted_run(tmp_path):
    whole = run(tmp_path / "whole", range(1, 7))
    # a run that died after logging step 5 with a checkpoint at step 3
    stale = {4: {"stale": 1.0}, 5: {"stale": 1.0}}
    run(tmp_path / "cut", range(1, 6), metrics=lambda s: {**step_metrics(s), **stale.get(s, {})})
    assert b"stale" in (tmp_path / "cut" / "metrics.jsonl").read_bytes()
    resumed = run(tmp_path / "cut", range(4, 7), start_step=3)
    assert resumed == whole
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert not [f for f in os.listdir(tmp_path / "cut") if f.startswith(".metrics")]


def test_fresh_run_starts_empty(tmp_path):
    run(tmp_path, range(1, 4))
    assert run(tmp_path, [1]) == (json.dumps({"step": 1, **step_metrics(1)}) + "\n").encode()


def test_killed_write_fragment(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run(tmp_path, range(1, 4))
    with open(path, "a") as f:
        f.write('{"step": 4, "reward/me')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert run(tmp_path, [4], start_step=3) == run(tmp_path / "whole", range(1, 5))


def test_corrupt_whole_line_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON metrics line"):
        read_metrics(path)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        logger(tmp_path, start_step=3)


def test_refusals(tmp_path):
    log = logger(tmp_path)
    log.log(2, {"x": 1.0})
    with pytest.raises(ValueError, match="step 2 is not after the last logged step 2"):
        log.log(2, {"x": 1.0})
    with pytest.raises(ValueError, match="'step' is the line's own key"):
        log.log(3, {"step": 1})
    with pytest.raises(TypeError, match="'t' must be a float, int, str or None, got list"):
        log.log(3, {"t": [1.0]})
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match=r"log\(\) after close\(\)"):
        log.log(3, {})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2]
    with pytest.raises(ValueError, match=r"start_step \(11\) must be in \[0, total_steps \(10\)\]"):
        logger(tmp_path, start_step=11)
    with pytest.raises(ValueError, match="wandb_mode must be one of"):
        logger(tmp_path, wandb_mode="on")


def test_resumed_logger_refuses_an_old_step(tmp_path):
    run(tmp_path, range(1, 6))
    with logger(tmp_path, start_step=3) as log, pytest.raises(ValueError, match="last .* 3"):
        log.log(3, {})


def test_wandb_mode_and_run_id(tmp_path):
    assert M.resolve_wandb_mode("auto", {}) == "offline"
    assert M.resolve_wandb_mode("auto", {"WANDB_API_KEY": ""}) == "offline"
    assert M.resolve_wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert M.resolve_wandb_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"
    assert M.resolve_wandb_mode("disabled", {"WANDB_API_KEY": "k"}) == "disabled"
    a = M.wandb_run_id("run", tmp_path, "n")
    assert a == M.wandb_run_id("run", tmp_path / "x" / "..", "n") and len(a) == 16
    assert a != M.wandb_run_id("run2", tmp_path, "n") and a != M.wandb_run_id(
        "run", tmp_path / "b", "n"
    )
    assert a != M.wandb_run_id("run", tmp_path, "m")
    first = M.run_nonce(tmp_path, fresh=True)
    assert M.run_nonce(tmp_path, fresh=False) == first  # a resume reads it back
    assert M.run_nonce(tmp_path, fresh=True) != first  # a fresh run draws its own


def test_without_wandb_auto_is_disabled_and_an_explicit_mode_is_refused(monkeypatch):
    # An offline GPU host has no wandb: metrics.jsonl is then the record.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))  # fmt: skip
    assert M.resolve_wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "disabled"
    assert M.resolve_wandb_mode("disabled", {}) == "disabled"
    for mode in ("offline", "online"):
        with pytest.raises(ValueError, match=f"wandb_mode = '{mode}' needs wandb.*'disabled'"):
            M.resolve_wandb_mode(mode, {})


def test_disabled_wandb_is_never_imported(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb now raises
    run(tmp_path, [1, 2])


def test_console_lines_without_a_tty(tmp_path):
    out = io.StringIO()
    with logger(tmp_path, console=out, progress=True, total_steps=2) as log:
        log.log(1, FULL)
        log.log(2, {M.REWARD_MEAN: 0.5})
    assert out.getvalue() == f"{format_line(1, 2, FULL)}\nstep 2/2 | reward 0.50\n"


def test_progress_bar_on_a_tty(tmp_path):
    out = TTY()
    with logger(tmp_path, console=out, total_steps=4, start_step=1, progress=True) as log:
        log.log(2, {M.REWARD_MEAN: 0.5})
        log.log(3, {M.REWARD_MEAN: 0.6})
    text = out.getvalue()
    assert "step 2/4 | reward 0.50\n" in text and "step 3/4 | reward 0.60\n" in text
    assert "3/4" in text.replace("step 3/4", "") and "1/4" in text
    quiet = TTY()
    with logger(tmp_path, console=quiet, total_steps=4, start_step=3, progress=False) as log:
        log.log(4, {})
    assert quiet.getvalue() == "step 4/4\n"


def test_real_offline_wandb_run(tmp_path, monkeypatch):
    try:
        import wandb  # noqa: F401
    except ImportError:
        pytest.fail("wandb is not installed: it is a dependency of the metrics sinks; add it to "
                    "the test requirements")  # fmt: skip
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    ids = []
    started = 0
    for start, steps in ((0, [1, 2]), (2, [3])):
        # wandb names an offline run's folder by the second its run starts in: a resume in the
        # fresh run's second would share that folder (a real resume never comes that soon)
        while int(time.time()) <= started:
            time.sleep(0.05)
        with MetricsLogger(out, run_name="tiny", config={"lr": 1e-3}, total_steps=3,
                           start_step=start, wandb_mode="auto", console=io.StringIO(),
                           progress=False) as log:  # fmt: skip
            started = int(time.time())  # wandb's run has started by now
            assert log.wandb_mode == "offline"
            ids.append(log._run.id)
            assert log._run.config["lr"] == 1e-3
            for s in steps:
                log.log(s, {M.REWARD_MEAN: s / 4, "note": "not numeric", M.WEIGHT_VERSION: s})
            assert log._run.summary[M.REWARD_MEAN] == steps[-1] / 4
    run_id = M.wandb_run_id("tiny", out, (out / M.WANDB_NONCE).read_text().strip())
    assert ids == [run_id, run_id]  # the resumed logger continues the fresh run's wandb run
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2 and all(list(r.glob("*.wandb")) for r in runs)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
