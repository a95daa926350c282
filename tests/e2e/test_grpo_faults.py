"""`onpolicy e2e` when a part of the run fails: each run is the CLI on configs/tiny-cpu.toml at
the smallest layouts (2 Megatron ranks TP2 SP, one exact SGLang engine TP1), with a real fault
made from outside while it runs. Each must end with exit 3, a one-line cause naming the actor
and what it was doing, and no process of the run left:

- an engine killed (SIGKILL) while it samples step 2's rollout;
- a trainer rank killed (SIGKILL) after step 1;
- a trainer rank stopped (SIGSTOP) after step 1, so its peer waits in a collective: the next
  call gets no answer within run.actor_timeout_s and the stopped rank is named as stopped;
- a trainer rank's save raising (the checkpoints folder is a file by then): the actor's root
  exception, not Ray's wrapper, is the cause given.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from cli_run import Run, sets, stopped_on_error

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.toml"
SMALL = ("run.wandb_mode=disabled", "training.world=2", "training.tp=2", "training.pp=1",
         "training.ep=1", "rollout.engines=1", "rollout.tp=1", "rollout.ep=1")  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(out: Path, *overrides: str, cache: Path) -> Run:
    return Run(CONFIG, out, *sets(*SMALL, *overrides), steps=3, cache=cache)


def _pids(run: Run) -> dict[str, int]:
    return json.loads((run.out / "actors.json").read_text())


def _rows(run: Run) -> int:
    try:
        return len((run.out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _cause(run: Run, what: str) -> str:
    """The run's one-line report of what stopped it ("onpolicy e2e: <what>: ...")."""
    lines = [ln for ln in run.text.splitlines() if ln.startswith(f"onpolicy e2e: {what}: ")]
    assert len(lines) == 1, run.text[-4000:]
    return lines[0]


def test_an_engine_killed_mid_rollout_stops_the_run(tmp_path, compile_cache):
    with stopped_on_error():
        # long responses: step 2's rollout lasts seconds, and the kill lands inside it
        run = _run(tmp_path / "engine", "grpo.max_new_tokens=96", cache=compile_cache)
        assert run.until(lambda: _rows(run) >= 1), run.text[-4000:]
        os.kill(_pids(run)["engine0"], signal.SIGKILL)
        code = run.wait()
    assert code == 3, run.text[-4000:]
    assert _cause(run, "generate").startswith("onpolicy e2e: generate: engine0 died: "), run.text[
        -3000:
    ]
    assert [r["step"] for r in run.metrics()] == [1], run.text[-3000:]
    run.check_clean()


def test_a_killed_trainer_rank_stops_the_run(tmp_path, compile_cache):
    with stopped_on_error():
        run = _run(tmp_path / "trainer", cache=compile_cache)
        assert run.until(lambda: _rows(run) >= 1), run.text[-4000:]
        os.kill(_pids(run)["trainer rank 1"], signal.SIGKILL)
        code = run.wait()
    assert code == 3, run.text[-4000:]
    causes = [ln for ln in run.text.splitlines() if ln.startswith("onpolicy e2e: ")
              and ": trainer rank 1 died" in ln]  # fmt: skip
    assert len(causes) == 1, run.text[-4000:]
    assert [r["step"] for r in run.metrics()] == [1], run.text[-3000:]
    run.check_clean()


def test_a_hung_trainer_rank_is_named_and_stops_the_run(tmp_path, compile_cache):
    with stopped_on_error():
        run = _run(tmp_path / "hung", "run.actor_timeout_s=30", cache=compile_cache)
        assert run.until(lambda: _rows(run) >= 1), run.text[-4000:]
        pid = _pids(run)["trainer rank 1"]
        os.kill(pid, signal.SIGSTOP)
        code = run.wait()
    assert code == 3, run.text[-4000:]
    cause = _cause(run, "score")
    assert f"trainer rank 1 (pid {pid}, stopped)" in cause, cause
    assert "no answer from" in cause and "within 30 s" in cause, cause
    run.check_clean()


def test_an_actor_that_raises_is_reported_by_its_root_exception(tmp_path, compile_cache):
    with stopped_on_error():
        run = _run(tmp_path / "raises", "run.checkpoint_every=1", cache=compile_cache)
        assert run.until(lambda: (run.out / "actors.json").exists()), run.text[-4000:]
        (run.out / "checkpoints").write_text("not a folder\n")  # before step 1's save
        code = run.wait()
    assert code == 3, run.text[-4000:]
    cause = _cause(run, "save")
    assert cause.startswith("onpolicy e2e: save: trainer rank ") and " failed: " in cause, cause
    assert "Error: " in cause and "checkpoints" in cause and "RayTaskError" not in cause, cause
    run.check_clean()
