"""A failed actor call is reported by its root exception, not by Ray's wrapper."""

from __future__ import annotations

import ray.exceptions as rx
from onpolicy.grpo.cluster import _cause

TRACEBACK = """Traceback (most recent call last):
  File "actors.py", line 227, in setup
    self.chunks, self.optimizer = setup_training(built(), s.optimizer)
  File "torch/optim/adamw.py", line 40, in __init__
    raise ValueError(f"Invalid learning rate: {lr}")
ValueError: Invalid learning rate: -0.001"""


def test_the_root_exception_of_a_failed_call_is_named():
    err = rx.RayTaskError(
        "TrainerActor.setup", TRACEBACK, ValueError("Invalid learning rate: -0.001")
    )
    assert _cause(err) == "ValueError: Invalid learning rate: -0.001"


def test_a_chained_cause_is_followed_to_where_it_started():
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        err = rx.RayTaskError("TrainerActor.save", "Traceback ...", outer)
    assert _cause(err) == "OSError: [Errno 28] No space left on device"


def test_a_dead_actor_keeps_rays_report():
    err = rx.ActorDiedError()
    text = _cause(err)
    assert text and "\n" not in text and "ValueError" not in text
