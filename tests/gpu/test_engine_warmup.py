"""An exact SGLang engine on CUDA compiles its prefill's Triton variants at start
(`onpolicy.rollout.warmup`, run by `launch`): afterwards a workload of co-batched prompts of
varied lengths (test_sglang_cuda's 1 to 2049 tokens, one of 3000, random batches; sampled and
greedy, 8 new tokens each) adds no kernel to Triton's cache. The engine is configs/one-gpu.toml's
(Qwen3-30B-A3B's layer dims, 4 layers, seeded), TP1, decode graphs up to 16 requests, each run
in a process of its own (workers/engine_warmup.py) with a fresh TRITON_CACHE_DIR. Negative
control: launched with `warm_up=False`, the same workload adds kernels to its cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onpolicy.contract import load_config, model_checkpoint, resolve_plan
from onpolicy.rendezvous import run_group
from onpolicy.rollout.engine import engine_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "one-gpu.toml"
WORKER = Path(__file__).parent / "workers" / "engine_warmup.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """configs/one-gpu.toml's seeded checkpoint, written once for the module."""
    return model_checkpoint(load_config(CONFIG), tmp_path_factory.mktemp("one-gpu"))


def run(tmp_path: Path, ckpt: Path, *args: str) -> dict:
    """The worker's JSON line; its engine in the run's environment (`onpolicy parity`'s rollout
    has the same) with Triton's cache in a fresh folder."""
    cfg = load_config(CONFIG)
    base = {**os.environ, **resolve_plan(cfg).rollout_env}
    env = engine_env(1, tmp_path / "engine", cfg.device, base=base)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "integration"),
                                                    os.environ.get("PYTHONPATH")) if p)  # fmt: skip
    try:  # a hung worker is killed with the engine's processes
        p = run_group([sys.executable, str(WORKER), "--ckpt", str(ckpt), *args], env=env,
                      timeout=900, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the engine worker ran past 900 s:\n{(e.stderr or '')[-4000:]}")
    assert p.returncode == 0, p.stderr[-4000:]
    warm = [x for x in p.stderr.splitlines() if x.startswith("onpolicy engine warm-up:")]
    out = json.loads(p.stdout.strip().splitlines()[-1]) | {"warm_up": warm}
    print(out)
    return out


def test_after_the_engine_warm_up_the_workload_compiles_nothing(tmp_path, checkpoint):
    out = run(tmp_path, checkpoint)
    assert len(out["warm_up"]) == 1 and out["kernels_after_launch"] > 0, out
    assert out["new"] == [], (
        f"the workload compiled {len(out['new'])} kernels the engine's warm-up did not: "
        f"{', '.join(out['new'])}"
    )


def test_negative_control_without_the_warm_up_the_workload_compiles(tmp_path, checkpoint):
    out = run(tmp_path, checkpoint, "--no-warm-up")
    assert out["warm_up"] == [] and out["kernels_after_launch"] > 0, out
    assert len(out["new"]) > 0, out
