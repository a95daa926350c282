"""The CUDA backend's kernel logic, checked on CPU through Triton's interpreter (see
cuda_interpreted.py; its `tl.dot` is interpreter_dot's fixed-order fp32 chain, so the bits do
not depend on the machine's BLAS); the GPU itself runs the same properties under `-m gpu`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NAMES = [
    "interpreter_dot_is_the_fixed_fma_chain",
    "gemm_segments_sum_by_the_pairwise_tree",
    "gemm_rows_are_independent_of_the_batch",
    "gemm_shards_of_whole_segments_are_exact",
    "attention_decode_and_chunks_equal_packed_prefill",
    "a_paged_batch_derives_its_schedule_once",
    "packed_sequences_do_not_see_each_other",
    "unmasked_blocks_give_the_masked_bits",
    "prefetched_loads_give_the_one_loop_bits",
    "moe_grouped_rows_equal_linear_per_expert",
    "moe_schedule_is_the_stable_sorts",
    "row_kernels_are_row_independent_and_match_the_cpu_backend",
    "logprobs_vocab_parallel_equal_full",
    "noise_is_the_cpu_backends_bits",
    "qk_norm_rope_is_norm_then_rope",
    "kv_store_writes_each_row_at_its_slot",
    "rope_positions_are_read_back_once_a_tensor",
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    """name -> "ok" or "FAIL ..." for every check; fails outright unless the script ran to
    its END line (a crash midway, a non-zero exit, or a lost line)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "integration"), str(HERE)])
    proc = subprocess.run([sys.executable, str(HERE / "cuda_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    out = proc.stdout.splitlines()
    lines = dict(line.split(" ", 1) for line in out[:-1] if " " in line)
    finished = bool(out) and out[-1] == f"END {len(lines)}" and len(lines) == len(out) - 1
    assert proc.returncode == 0 and finished, (
        f"interpreter run failed (exit {proc.returncode}):\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return lines


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_kernel(results, name):
    assert results.get(name) == "ok", results.get(name, "not run")


def test_every_check_is_listed(results):
    assert sorted(results) == sorted(NAMES)
