"""The trainer's compile warm-up (`TrainerActor.warm_up`: scoring, then the update's forward
and backward, on the warm-up batches, with no optimizer step) leaves nothing behind: the next
PPO step gives the loss, the gradient norm and the parameters, bit for bit, that it gives with
no warm-up. On CUDA the warm-up runs at every setup (a resumed run too), so a trace of it
would also be in every step. Control: one real step in place of the warm-up moves all three.
Each case is one trainer rank at world 1 on CPU/gloo in its own process
(workers/trainer_warmup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "trainer_warmup.py"


@pytest.fixture(scope="module")
def runs(tiny_checkpoint) -> dict[str, dict]:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "integration"), "OMP_NUM_THREADS": "1"}
    out = {}
    for before in ("nothing", "warmup", "step"):
        proc = subprocess.run([sys.executable, str(WORKER), "--ckpt", str(tiny_checkpoint),
                               "--before", before], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[before] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    return out


def test_a_warm_up_leaves_the_next_step_bit_for_bit(runs):
    plain, warmed = runs["nothing"], runs["warmup"]
    assert warmed["warmup_batches"] > 1, warmed
    for what in ("loss", "grad_norm", "digest"):
        assert warmed[what] == plain[what], (what, warmed, plain)


def test_negative_control_a_real_step_before_moves_the_next_one(runs):
    plain, stepped = runs["nothing"], runs["step"]
    for what in ("loss", "grad_norm", "digest"):
        assert stepped[what] != plain[what], (what, stepped, plain)
