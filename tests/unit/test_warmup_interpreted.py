"""The warm-up batches (`onpolicy.kernels.cuda.warmup`) launch every Triton variant that 300
random batches launch, keyed as the GPU's JIT keys them (see warmup_interpreted.py, run in a
subprocess under Triton's interpreter). `tests/gpu/test_warmup.py` checks the same with real
compiles on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "integration"), str(HERE)])
    proc = subprocess.run([sys.executable, str(HERE / "warmup_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    return out


@pytest.mark.parametrize("name", ["gqa2", "qwen3-30b-heads", "trainer", "fp32"])
def test_the_warm_up_covers_random_batches(cases, name):
    case = cases[name]
    assert case["warm"] > 0 and case["later"] > 0, case
    assert case["missed"] == [], case
    # Control: a warm-up on the largest batch alone misses variants of the same batches.
    assert case["missed_by_largest_only"] > 0, case


def test_negative_control_a_specialized_m_escapes_the_warm_up(cases):
    """With the GEMM's M specialized again (1, multiples of 16, the rest), a batch of 528 tokens
    (LARGE M, a multiple of 16) has a variant no warm-up batch has."""
    assert cases["gqa2"]["missed_when_m_specialized"] > 0, cases["gqa2"]
