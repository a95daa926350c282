"""Every wait around the engine host is bounded and named (onpolicy.rollout.host).

A real tiny engine per case (tp 1): a client that connects and never says a word does not hold
the host, and `stop()` returns within its bound, the engine shut down cleanly (exit 0, not the
kill), while another client stays connected. Each blocking call runs on a thread joined with a
bound, so a hang fails the test instead of holding it. Without an engine: a client's connect to
a host that never answers is bounded and named, and so is `nvidia-smi` (gpu_memory_used).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

STOP_S = 60.0
"""The bound each case gives `EngineHost.stop()`."""


def within(seconds: float, what: str, fn, *args, **kw):
    """fn(*args, **kw) on a thread; its value, or a failure naming `what` if it is not back
    within `seconds` (the thread is left behind, a daemon)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{what}: not back within {seconds:.0f} s")
    if "error" in out:
        raise out["error"]
    return out["value"], time.monotonic() - t0


@pytest.fixture
def host(tiny_checkpoint, compile_cache, tmp_path):
    from onpolicy.rollout.host import EngineHost

    h = EngineHost.start("waits", tiny_checkpoint, tmp_path, tp=1, ep=1, cache=compile_cache)
    try:
        yield h.wait(timeout=600)
    finally:
        if h.proc.poll() is None:  # a case that failed: the host and its engine go
            os.killpg(h.proc.pid, signal.SIGKILL)
            h.proc.wait()


def _address(h) -> tuple[str, int]:
    a = json.loads(h.address_file.read_text())
    return a["host"], a["port"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_client_that_connects_and_never_sends_does_not_hold_the_host(host):
    from onpolicy.rollout.host import STALL_S

    silent = socket.create_connection(_address(host))  # never answers the host's challenge
    try:
        client, took = within(STALL_S + 60, "a connect behind a silent one", host.connect)
        info, _ = within(60, "info", client.call, "info", timeout=60)
        assert info["pid"] == host.proc.pid
        client.close()
        _, took = within(STOP_S + 30, "stop() with a silent connection open", host.stop,
                         timeout=STOP_S)  # fmt: skip
    finally:
        silent.close()
    assert host.proc.returncode == 0, f"killed, not shut down (exit {host.proc.returncode})"
    assert took < STOP_S
    assert "that did not authenticate within" in host.log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stop_returns_within_its_bound_while_a_client_stays_connected(host):
    from onpolicy.rollout.host import EngineError

    idle = host.connect()
    within(60, "info", idle.call, "info", timeout=60)  # a session, then idle, never closed
    _, took = within(STOP_S + 30, "stop() with a client connected", host.stop, timeout=STOP_S)
    assert host.proc.returncode == 0, f"killed, not shut down (exit {host.proc.returncode})"
    assert took < STOP_S
    with pytest.raises(EngineError, match="waits: the engine process died during info"):
        idle.call("info", timeout=30)


def test_a_connect_to_a_host_that_never_answers_is_bounded_and_named(tmp_path):
    from onpolicy.rollout.host import EngineClient, EngineError

    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts; nobody speaks
        port = mute.getsockname()[1]
        (tmp_path / "a.json").write_text(json.dumps({"host": "127.0.0.1", "port": port,
                                                     "tp": 1, "ep": 1}))  # fmt: skip
        with pytest.raises(EngineError, match=rf"mute: the engine host at 127\.0\.0\.1:{port} "
                           r"did not authenticate this client within 2 s"):  # fmt: skip
            within(30, "connect", EngineClient.connect, "mute", tmp_path / "a.json", "00" * 16,
                   timeout=2)  # fmt: skip


def test_nvidia_smi_is_bounded_and_named(tmp_path, monkeypatch):
    from onpolicy.grpo.memory import gpu_memory_used

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")  # a wedged driver
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"nvidia-smi gave no answer within 1 s"):
        within(30, "gpu_memory_used", gpu_memory_used, timeout=1)


def test_teardown_memory_is_held_to_the_use_before_the_run_not_to_zero():
    """A shared GPU (another tenant's 5000 MiB) passes when the run gave back what it took; a
    GPU above its use before the run fails, named; without a reading from before, 0 is the
    rule."""
    from onpolicy.grpo.e2e import memory_left

    assert memory_left([5000, 0], [5000, 0]) == ""
    assert memory_left([5000, 300], [4000, 0]) == ""  # the other tenant freed some
    left = memory_left([5000, 0], [5000, 812])
    assert left == "[gpu_memory] GPU memory above its use before the run: GPU 1 812 MiB (before 0)"
    assert memory_left(None, [0, 0]) == ""
    assert (
        memory_left(None, [0, 2])
        == "[gpu_memory] GPU memory not back to 0 MiB: GPU 1 2 MiB (before 0)"
    )


def test_teardown_memory_is_read_again_until_the_killed_processes_give_it_back():
    """The driver frees a killed process's GPU memory after the process has gone: the reading is
    taken again until nothing is left, and bounded when something stays (then named)."""
    from onpolicy.grpo.e2e import memory_after_teardown, memory_left

    readings = iter([[92085], [40000], [4], [4]])
    used, waited = memory_after_teardown([4], settle_s=30, interval_s=0.01,
                                         read=lambda: next(readings))  # fmt: skip
    assert used == [4] and next(readings) == [4], used  # it stopped at the first good reading
    assert 0 < waited < 30, waited

    t0 = time.monotonic()
    used, waited = memory_after_teardown([4], settle_s=0.2, interval_s=0.01,
                                         read=lambda: [812])  # fmt: skip
    assert used == [812] and 0.2 <= waited < 5 and time.monotonic() - t0 < 5, (used, waited)
    assert "GPU 0 812 MiB (before 4)" in memory_left([4], used)

    def fails():
        raise RuntimeError("nvidia-smi gave no answer within 60 s (memory.used)")

    with pytest.raises(RuntimeError, match="nvidia-smi gave no answer"):
        memory_after_teardown([4], read=fails)
