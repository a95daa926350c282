"""The CUDA backend's kernel logic, checked on CPU through Triton's interpreter (see
cuda_interpreted.py); the GPU itself runs the same properties under `-m gpu`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NAMES = [
    "gemm_leaves_sum_by_the_pairwise_tree",
    "gemm_rows_are_independent_of_the_batch",
    "gemm_shards_of_whole_leaves_are_exact",
    "attention_decode_and_chunks_equal_packed_prefill",
    "packed_sequences_do_not_see_each_other",
    "moe_grouped_rows_equal_linear_per_expert",
    "row_kernels_are_row_independent_and_match_the_cpu_backend",
    "logprobs_vocab_parallel_equal_full",
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "integration"), str(HERE)])
    proc = subprocess.run([sys.executable, str(HERE / "cuda_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stderr[-3000:]}"
    return lines


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_kernel(results, name):
    assert results.get(name) == "ok", results.get(name, "not run")


def test_every_check_is_listed(results):
    assert sorted(results) == sorted(NAMES)
