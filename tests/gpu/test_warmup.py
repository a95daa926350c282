"""After the warm-up batches, scoring any batch of at most max_tokens tokens compiles nothing
(`onpolicy.kernels.cuda.warmup`). Each case runs in its own process with an empty Triton cache,
so every variant is a real compile; the negative control warms up on the largest batch only,
and the same later batches then compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).parent / "workers" / "warmup.py"


def run(tmp_path: Path, *args: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    return out


def test_after_the_warm_up_later_batches_compile_nothing(tmp_path):
    out = run(tmp_path)
    assert out["warmup"]["compiles"] > 0, out
    assert out["later"]["compiles"] == 0 and out["later"]["hits"] == 0, out


def test_negative_control_a_warm_up_on_the_largest_batch_leaves_compiles(tmp_path):
    out = run(tmp_path, "--largest-only")
    assert out["later"]["compiles"] > 0, out
