"""Fixtures of the engine tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import exact_and_stock as pair
import pytest

TRAINER_WORKER = Path(__file__).parent / "workers" / "trainer_warmup.py"


@pytest.fixture(scope="session")
def exact_and_stock(tiny_checkpoint, torchrun, tmp_path_factory, compile_cache) -> dict:
    """One exact and one stock engine, then one trainer job, for the routing and `--bisect`
    checks (exact_and_stock.run)."""
    work = tmp_path_factory.mktemp("exact-and-stock")
    return pair.run(tiny_checkpoint, torchrun, work, compile_cache)


@pytest.fixture(scope="session")
def trainer_runs(tiny_checkpoint, tmp_path_factory) -> dict:
    """One trainer rank at world 1 on CPU/gloo per case of workers/trainer_warmup.py: before
    its PPO step nothing, the compile warm-up, or one real step; {case: its JSON line}. The
    "nothing" run also pickles its `score` result under "score_out"."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "integration"), "OMP_NUM_THREADS": "1"}
    score_out = tmp_path_factory.mktemp("score")
    out: dict = {"score_out": score_out}
    for before in ("nothing", "warmup", "step"):
        extra = ["--score-out", str(score_out)] if before == "nothing" else []
        proc = subprocess.run([sys.executable, str(TRAINER_WORKER), "--ckpt",
                               str(tiny_checkpoint), "--before", before, *extra], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[before] = json.loads(proc.stdout.strip().splitlines()[-1])
    print({k: v for k, v in out.items() if k != "score_out"})
    return out
