"""Shared fixtures: a torchrun launcher (one fresh process group per multi-rank case)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: Path, nproc: int, *args: str, timeout: float = 600, env: dict | None = None
) -> str:
    """Run `script` under torchrun with `nproc` local ranks; return stdout, fail with the logs.
    Past `timeout` torchrun and every rank are killed (its process group), never left behind."""
    from onpolicy.rendezvous import loopback_env, run_group, torchrun

    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "integration"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
        ),
        **loopback_env(),
        **(env or {}),
    }
    try:
        p = run_group(torchrun(nproc, str(script), *args), env=full_env, timeout=timeout,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun {script.name} x{nproc} {' '.join(args)}: no result within "
                    f"{timeout:.0f} s, killed with its ranks\n--- stdout ---\n{e.output[-6000:]}"
                    f"\n--- stderr ---\n{e.stderr[-6000:]}")  # fmt: skip
    out, err = p.stdout, p.stderr
    if p.returncode != 0:
        pytest.fail(
            f"torchrun {script.name} x{nproc} {' '.join(args)} exited {p.returncode}\n"
            f"--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
        )
    return out


@pytest.fixture(scope="session")
def torchrun():
    """`torchrun(script, nproc, *args)`: a fresh multi-process job; returns its stdout."""
    return run_torchrun


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> Path:
    """SGLang's and inductor's compile caches, one folder for every engine the session starts
    (an engine's first forward compiles; a warm cache skips that)."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The default seeded tiny Qwen3-MoE (bf16 weights, HF layout), written once per session."""
    from onpolicy.models import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe", seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    """HF transformers Qwen3MoeForCausalLM on the tiny checkpoint, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return model.eval()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are collected everywhere and skipped, with the reason, where there is no CUDA."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run with -m gpu on the GPU machine")
    for item in gpu:
        item.add_marker(skip)
