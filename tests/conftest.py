"""Shared fixtures: the multi-rank job launcher (one fresh process group per multi-rank case),
and the check that nothing the session starts listens beyond loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from listeners import Listeners

REPO = Path(__file__).resolve().parents[1]
RAY_MULTI_NODE_OFF = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray reads this once, at its first import, and with it off a head on 127.0.0.1 binds only there.
# The run's driver sets it before it imports Ray (grpo.cluster); in this process test modules
# import Ray at collection, before any test, so it is set here. The e2e runs are processes of
# their own and do not inherit it (cli_run.Run), so they test the driver's own setting.
os.environ[RAY_MULTI_NODE_OFF] = "0"


def run_torchrun(
    script: Path, nproc: int, *args: str, timeout: float = 600, env: dict | None = None
) -> str:
    """Run `script` as a job of `nproc` local ranks (`onpolicy.rendezvous.torchrun`); return
    stdout, fail with the logs. Past `timeout` the launcher and every rank are killed (its
    process group), never left behind, after each printed its stacks (PYTHONFAULTHANDLER).
    Fails too if a process of the job listened beyond loopback."""
    from onpolicy.rendezvous import run_group, torchrun

    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "integration"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
        ),
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    what = f"job {script.name} x{nproc} {' '.join(args)}"
    try:
        with Listeners(os.getpid()) as seen:
            p = run_group(torchrun(nproc, str(script), *args), env=full_env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what}: no result within {timeout:.0f} s, killed with its ranks (their "
                    f"stacks in stderr)\n--- stdout ---\n{e.output[-6000:]}\n--- stderr ---\n"
                    f"{e.stderr[-12000:]}")  # fmt: skip
    out, err = p.stdout, p.stderr
    if p.returncode != 0:
        pytest.fail(
            f"{what} exited {p.returncode}\n"
            f"--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}"
        )
    seen.check(what)
    return out


@pytest.fixture(scope="session")
def torchrun():
    """`torchrun(script, nproc, *args)`: a fresh multi-process job; returns its stdout."""
    return run_torchrun


SESSION: list[Listeners] = []
"""The session's watcher, once started (for the summary at the end)."""


@pytest.fixture(scope="session")
def session_listeners():
    """The listening sockets of every process this session starts (all descendants of pytest),
    sampled every 0.2 s from the first test to the last."""
    with Listeners(os.getpid()) as seen:
        SESSION.append(seen)
        yield seen


def pytest_terminal_summary(terminalreporter):
    """One line: what the session's processes listened on (the check's evidence)."""
    for seen in SESSION:
        ips = sorted({x.ip for x in seen.seen})
        terminalreporter.write_line(
            f"listeners: {len(seen.seen)} listening sockets of {len({x.pid for x in seen.seen})} "
            f"processes seen in {seen.samples} samples, on {', '.join(ips) or 'nothing'}; beyond "
            f"loopback: {len(seen.wild())} ({len(seen.wild() - seen.reported)} unreported)"
        )


@pytest.fixture(autouse=True)
def _nothing_listens_beyond_loopback(request, session_listeners):
    """After each test (and the fixtures set up for it): no process the session started has
    listened beyond loopback since the last test. A test that plants such a listener on
    purpose asks for `allow_wild_listeners`."""
    yield
    session_listeners.sample()
    new = session_listeners.wild() - session_listeners.reported
    session_listeners.reported |= new
    if new and "allow_wild_listeners" not in request.fixturenames:
        listed = ", ".join(map(str, sorted(new, key=lambda x: (x.pid, x.port))))
        pytest.fail(f"{request.node.nodeid}: listening beyond loopback: {listed}")


@pytest.fixture
def allow_wild_listeners():
    """This test's listeners beyond loopback are its point (a planted one, a control)."""


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
