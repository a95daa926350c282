"""A neighbour process taking memory, for the engine tests that start beside one."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil

GiB = 1 << 30

# Takes `hold` bytes in 256 MiB chunks (touched, so resident), says so, then holds them.
_TAKE = """
import sys, numpy
hold = int(sys.argv[1])
step = 256 << 20
n = max(hold // step, 1)
chunks = []
print("ready", flush=True)
for i in range(n):
    chunks.append(numpy.ones(step, numpy.uint8))
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def neighbour_taking_memory(leave_gib: float):
    """A neighbour that takes all of this host's available memory but `leave_gib` and holds it
    until the block ends; the block starts once it holds it all (writing that much memory can
    take longer than the block's work on a loaded 2-core machine). Yields its pid and what it
    takes, in bytes. SGLang sizes a CPU engine's KV pool from the free memory it measures."""
    hold = max(psutil.virtual_memory().available - int(leave_gib * GiB), 0)
    cmd = [sys.executable, "-c", _TAKE, str(hold)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout.readline().strip() == "ready", "the neighbour did not start"
            assert p.stdout.readline().strip() == "held", "the neighbour did not take it"
            yield p.pid, hold
        finally:
            p.kill()
