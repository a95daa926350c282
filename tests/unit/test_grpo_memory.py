"""The run's memory per phase (onpolicy.grpo.memory): the phase's lowest and highest readings,
the readings at a short phase's start and end, and the run's summed resident size from its processes
alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from onpolicy.grpo.memory import PhasePeaks, run_rss_mib
from onpolicy.grpo.procs import RUN_ID_ENV


def test_each_phase_keeps_its_lowest_and_highest_reading():
    value = {"v": 10}
    peaks = PhasePeaks(lambda: value["v"], interval_s=0.01)
    try:
        with peaks.phase("rollout"):
            value["v"] = 500  # up and down inside the phase: the sampler sees the peak
            time.sleep(0.2)
            value["v"] = 5  # and the low
            time.sleep(0.2)
            value["v"] = 20
            time.sleep(0.05)
        value["v"] = 9000  # between phases: counted nowhere
        time.sleep(0.1)
        value["v"] = 30
        with peaks.phase("train"):
            time.sleep(0.05)
        got = peaks.take()
    finally:
        peaks.close()
    assert got == {"rollout": (5, 500), "train": (30, 30)}, got


def test_a_phase_shorter_than_the_interval_gets_its_start_and_end_readings():
    seen = []
    lock = threading.Lock()

    def probe() -> int:
        with lock:
            seen.append(1)
            return 100 * len(seen)

    peaks = PhasePeaks(probe, interval_s=60.0)  # the sampler never fires in this test
    try:
        with peaks.phase("sync"):
            pass
        got = peaks.take()
        assert peaks.take() == {}  # take empties
    finally:
        peaks.close()
    assert len(seen) == 2 and got == {"sync": (100, 200)}, (seen, got)


def test_the_runs_resident_size_counts_its_processes_and_no_others():
    code = "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True)"
    code += "; import time; time.sleep(60)"
    env = {**os.environ, RUN_ID_ENV: "memory-test-run"}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        ours = run_rss_mib("memory-test-run")
        other = run_rss_mib("another-run")
    finally:
        p.kill()
        p.wait()
    assert ours >= 300, ours
    assert other == 0, other


def test_a_colocated_cuda_run_needs_torch_memory_saver_and_names_the_rule():
    import importlib.util
    from pathlib import Path

    from onpolicy.contract import load_config
    from onpolicy.grpo.cluster import memory_saver_problem

    configs = Path(__file__).resolve().parents[2] / "configs"
    one_gpu = load_config(configs / "one-gpu.toml")
    assert one_gpu.device == "cuda" and one_gpu.rollout.colocate
    problem = memory_saver_problem(one_gpu)
    if importlib.util.find_spec("torch_memory_saver") is None:  # this Python cannot release
        assert problem.startswith("[memory_saver] rollout.colocate = true on CUDA"), problem
        assert "torch-memory-saver==0.0.10" in problem and "install-loop" in problem, problem
    else:
        assert problem == ""
    # Nothing to release: not colocated, or on CPU.
    apart = load_config(configs / "one-gpu.toml", {"rollout.colocate": False})
    assert memory_saver_problem(apart) == ""
    assert memory_saver_problem(load_config(configs / "tiny-cpu.toml")) == ""
