"""`train.builder.deterministic_cuda`, which `init_parallel` applies on CUDA, sets what it says
on this torch: deterministic algorithms (warning, not failing, on an op without one), the
cuBLAS workspace variable (a user's own value kept), and no filling of new tensors. Its effect
on a backward is tests/gpu/test_deterministic_training.py's. Each case runs in its own process:
the settings are global."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, torch
from torch.utils import deterministic
from onpolicy.train.builder import deterministic_cuda
before = torch.are_deterministic_algorithms_enabled()
deterministic_cuda()
print(json.dumps([before, torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled(),
                  deterministic.fill_uninitialized_memory,
                  os.environ.get("CUBLAS_WORKSPACE_CONFIG")]))
"""


@pytest.mark.parametrize("preset", [None, ":16:8"])
def test_deterministic_cuda_sets_torch_and_cublas(preset):
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    if preset:
        env["CUBLAS_WORKSPACE_CONFIG"] = preset
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    before, enabled, warn_only, fill, cublas = json.loads(out.strip().splitlines()[-1])
    assert (before, enabled, warn_only, fill) == (False, True, True, False)
    assert cublas == (preset or ":4096:8")
