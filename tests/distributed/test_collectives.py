"""The deterministic collectives on gloo at world 2, 4 and 8: one torchrun launch per world.

Each launch runs every check of workers/collectives_worker.py and prints one RESULT line per
check; each (world, check) pair is reported here as its own test. The NOTE lines (the negative
control's counts) are printed with `-s`.
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
    "negative_control",
    "ep_dispatch_combine",
    "non_power_of_2_refused",
    "comm_bytes",
]

_runs: dict[int, dict[str, str]] = {}


@pytest.fixture(scope="module")
def results(torchrun):
    """`results(world)`: map check name -> 'PASS' or 'FAIL ...', one launch per world size."""
    return lambda world: _results(torchrun, world)


def _results(run_torchrun, world: int) -> dict[str, str]:
    if world not in _runs:
        out = run_torchrun(WORKER, world, timeout=300)
        print(f"\n--- collectives at world {world} ---")
        print("\n".join(line for line in out.splitlines() if line.startswith("NOTE")))
        _runs[world] = {
            line.split(" ", 2)[1]: line.split(" ", 2)[2]
            for line in out.splitlines()
            if line.startswith("RESULT ")
        }
    return _runs[world]


def _expected(world: int) -> list[str]:
    """A group of 3 ranks needs a world of at least 4."""
    return [c for c in CHECKS if world >= 4 or c != "non_power_of_2_refused"]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "check"), [(w, c) for w in WORLDS for c in _expected(w)])
def test_collective(results, world: int, check: str) -> None:
    got = results(world)
    assert check in got, f"world {world}: the worker did not report {check}: {got}"
    assert got[check] == "PASS", f"world {world}: {check}: {got[check]}"


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_worker_reports_every_check(results, world: int) -> None:
    assert sorted(results(world)) == sorted(_expected(world))
