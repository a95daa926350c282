"""The run's processes: how they are marked, found and reaped at teardown.

Every process of a run (the driver, Ray's head and workers, the engines' schedulers) carries
RUN_ID_ENV in its environment; teardown waits for them to exit, then kills and names any left.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from onpolicy.rendezvous import proc_stat

RUN_ID_ENV = "ONPOLICY_RUN_ID"
"""Set in the driver and inherited by every process of the run (Ray's head and workers, the
engines' schedulers): how teardown finds what is left of the run. The driver sets a fresh id
(or the one `onpolicy e2e --run-id` names); an id inherited from its own environment is not
reused, so a run never counts the shell or tool that started it as one of its processes."""


def ancestors(pid: int | None = None) -> set[int]:
    """`pid` (default: this process) and every process above it, up to init."""
    pid = os.getpid() if pid is None else pid
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        fields = proc_stat(pid)
        if fields is None:
            break
        pid = int(fields[1])
    return seen


STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped",
          "t": "stopped by a tracer", "Z": "zombie"}  # fmt: skip


def state(pid: int) -> str:
    """A process's state as /proc reports it ("sleeping", "stopped", ...), "gone" if none."""
    fields = proc_stat(pid)
    return "gone" if fields is None else STATES.get(fields[0], fields[0])


def run_processes(run_id: str) -> list[int]:
    """Pids of live processes that carry the run's id in their environment, never this process
    or one above it (the driver's own parents are not the run's, whatever they inherited)."""
    found = []
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    spare = ancestors()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in spare:
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        fields = proc_stat(d.name)
        if fields is not None and needle in env.split(b"\0") and fields[0] != "Z":
            found.append(int(d.name))
    return found


def reap(run_id: str, grace_s: float = 20.0) -> list[str]:
    """Wait for the run's processes to exit; kill and describe any still there after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = []
    for pid in run_processes(run_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            os.kill(pid, signal.SIGKILL)
            left.append(f"{pid} {cmd}")
        except OSError:
            pass
    return left
