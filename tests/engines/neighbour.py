"""A neighbour process taking memory, for the engine tests that start beside one."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil

GiB = 1 << 30

# Takes `hold` bytes in 256 MiB chunks (touched, so resident) spread over `seconds`, then holds.
_TAKE = """
import sys, time, numpy
hold, seconds = int(sys.argv[1]), float(sys.argv[2])
step = 256 << 20
n = max(hold // step, 1)
chunks = []
print("ready", flush=True)
t0 = time.monotonic()
for i in range(n):
    chunks.append(numpy.ones(step, numpy.uint8))
    time.sleep(max(t0 + seconds * (i + 1) / n - time.monotonic(), 0))
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def neighbour_taking_memory(leave_gib: float, seconds: float, *, wait: bool = False):
    """A neighbour that takes all of this host's available memory but `leave_gib`, gradually
    over `seconds` from the block's start, and holds it until the block ends; yields its pid
    and what it takes, in bytes. SGLang sizes a CPU engine's KV pool from the free memory
    measured before and after the weights load: a neighbour taking memory in between is what
    could fail a start.
    With `wait`, the block starts only once the neighbour holds it all (writing that much
    memory can take longer than the block's work on a loaded 2-core machine)."""
    hold = max(psutil.virtual_memory().available - int(leave_gib * GiB), 0)
    cmd = [sys.executable, "-c", _TAKE, str(hold), str(seconds)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout.readline().strip() == "ready", "the neighbour did not start"
            if wait:  # the block starts once the neighbour holds all it takes
                assert p.stdout.readline().strip() == "held", "the neighbour did not take it"
            yield p.pid, hold
        finally:
            p.kill()
