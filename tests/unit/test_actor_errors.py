"""A failed actor call is reported by its root exception, not by Ray's wrapper; an OSError in
the driver is exit 3 on one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from onpolicy.grpo.cluster import _cause

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"

TRACEBACK = """Traceback (most recent call last):
  File "actors.py", line 227, in setup
    self.chunks, self.optimizer = setup_training(built(), s.optimizer)
  File "torch/optim/adamw.py", line 40, in __init__
    raise ValueError(f"Invalid learning rate: {lr}")
ValueError: Invalid learning rate: -0.001"""


@pytest.fixture
def rx():
    """Ray's exceptions, imported by the tests that use them: collecting this file needs no Ray,
    so `pytest -m gpu tests/unit` runs on a GPU host that has none."""
    import ray.exceptions

    return ray.exceptions


def test_the_root_exception_of_a_failed_call_is_named(rx):
    err = rx.RayTaskError(
        "TrainerActor.setup", TRACEBACK, ValueError("Invalid learning rate: -0.001")
    )
    assert _cause(err) == "ValueError: Invalid learning rate: -0.001"


def test_a_chained_cause_is_followed_to_where_it_started(rx):
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        err = rx.RayTaskError("TrainerActor.save", "Traceback ...", outer)
    assert _cause(err) == "OSError: [Errno 28] No space left on device"


def test_a_dead_actor_keeps_rays_report(rx):
    err = rx.ActorDiedError()
    text = _cause(err)
    assert text and "\n" not in text and "ValueError" not in text


def test_an_os_error_in_the_driver_is_exit_3_on_one_line(tmp_path, monkeypatch):
    """A full disk (or any OSError the system raises in the driver) ends the run with exit 3
    and one line naming the error, not a traceback and not exit 1 (a true-on-policy
    violation's code)."""
    import errno
    import io

    from onpolicy.grpo import e2e
    from onpolicy.grpo.config import load_e2e_config
    from onpolicy.grpo.driver import Driver

    def full_disk(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(Driver, "setup", full_disk)
    cfg = load_e2e_config(TINY, {"run.out": str(tmp_path / "run"), "run.wandb_mode": "disabled"})
    console = io.StringIO()
    assert e2e.run(cfg, console=console, run_id="os-error-test") == 3
    text = console.getvalue()
    assert "onpolicy e2e: OSError: [Errno 28] No space left on device" in text, text
    assert "Traceback" not in text and "stopped (exit 3)" in text, text
