"""The deterministic collectives on gloo at world 2, 4 and 8: one torchrun launch per world.

Each launch runs every check of workers/collectives_worker.py and prints one RESULT line per
check and one CONTROL line per negative control; each (world, check) pair is reported here as
its own test. The control counts are printed with `-s`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "collectives_worker.py"
WORLDS = [2, 4, 8]
CHECKS = [
    "ar_matches_tree",
    "ar_identical_on_ranks",
    "rs_equals_ar_slice",
    "all_gather_exact",
    "backward_pairs",
    "tp_linear",
    "ep_dispatch_combine",
    "ep_backward",
    "non_power_of_2_refused",
    "comm_bytes",
]
UNCONTROLLED = {"ep_backward", "non_power_of_2_refused", "comm_bytes"}
"""Checks that claim no exact bits: a gradient within tolerance, a refusal, byte counts."""
DATA_MOVEMENT = {"plain_all_gather"}
"""Controls where the plain op adds nothing, so it must agree at every world."""

_runs: dict[int, tuple[dict[str, str], list[tuple[str, str, int, int, str]]]] = {}


@pytest.fixture(scope="module")
def results(torchrun):
    """`results(world)`: (check -> 'PASS' or 'FAIL ...', the CONTROL rows), one launch a world."""
    return lambda world: _results(torchrun, world)


def _results(run_torchrun, world: int):
    if world not in _runs:
        out = run_torchrun(WORKER, world, timeout=300).splitlines()
        print(f"\n--- collectives at world {world} ---")
        print("\n".join(line for line in out if line.startswith(("NOTE", "CONTROL"))))
        got = {ln.split(" ", 2)[1]: ln.split(" ", 2)[2] for ln in out if ln.startswith("RESULT ")}
        controls = []
        for line in out:
            if line.startswith("CONTROL "):
                _, check, name, differ, total, expect = line.split()
                controls.append((check, name, int(differ), int(total), expect))
        _runs[world] = got, controls
    return _runs[world]


def _expected(world: int) -> list[str]:
    """A group of 3 ranks needs a world of at least 4."""
    return [c for c in CHECKS if world >= 4 or c != "non_power_of_2_refused"]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "check"), [(w, c) for w in WORLDS for c in _expected(w)])
def test_collective(results, world: int, check: str) -> None:
    got, _ = results(world)
    assert check in got, f"world {world}: the worker did not report {check}: {got}"
    assert got[check] == "PASS", f"world {world}: {check}: {got[check]}"


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_worker_reports_every_check(results, world: int) -> None:
    assert sorted(results(world)[0]) == sorted(_expected(world))


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_negative_controls(results, world: int) -> None:
    """Every exact check has controls; each broke (or, where no order can differ, agreed) as it
    said. Over ranks an order can differ only from t = 4: a two-operand sum commutes."""
    _, controls = results(world)
    controlled = {check for check, *_ in controls}
    assert controlled == set(_expected(world)) - UNCONTROLLED
    for check, name, differ, total, expect in controls:
        where = f"world {world}: {check}/{name}: {differ} of {total} differ"
        assert expect in ("differ", "agree"), where
        assert (differ > 0) == (expect == "differ"), f"{where}, expected to {expect}"
        if world >= 4 and name not in DATA_MOVEMENT:
            assert expect == "differ", f"{where}: at t >= 4 every order control must differ"
