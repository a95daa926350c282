"""The run's lowest and peak memory in each phase of a step, sampled while the driver names the
phase.

On CUDA the reading is the memory in use on the host's GPUs, all processes included (one
`nvidia-smi --loop-ms` process streams it), so an engine's pool and a trainer's tensors both
count; on CPU it is the resident set size of every process of the run, summed (an upper bound:
a page shared by two processes counts twice; their proportional sizes would not, but reading
them walks every page table, 22 ms for a 1.5 GB process, too slow to sample). A phase shorter
than the sampling interval still gets the readings at its start and its end.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from onpolicy.grpo.procs import run_processes

INTERVAL_S = 0.2
"""Seconds between readings."""
PAGE = os.sysconf("SC_PAGE_SIZE")


def run_rss_mib(run_id: str) -> int:
    """The summed resident set size of the run's processes, in MiB."""
    pages = 0
    for pid in run_processes(run_id):
        try:
            pages += int((Path("/proc") / str(pid) / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return pages * PAGE // (1 << 20)


QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def gpu_memory_used(timeout: float = 60.0) -> list[int]:
    """Memory used on every GPU of this host, in MiB (nvidia-smi); RuntimeError naming the
    wait if nvidia-smi gives no answer within `timeout` s (a wedged driver can hang it)."""
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, check=True,
                             timeout=timeout).stdout  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"nvidia-smi gave no answer within {timeout:.0f} s (memory.used): "
                           "the driver may be wedged") from None  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"nvidia-smi failed: {err}") from None
    return [int(x) for x in out.split()]


class GpuReader:
    """The latest total of `nvidia-smi`'s memory.used over the host's GPUs, in MiB, streamed by one
    `nvidia-smi --loop-ms` process (started here, stopped by `close`)."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self._gpus = len(gpu_memory_used())  # RuntimeError without a working nvidia-smi
        cmd = [*QUERY, f"--loop-ms={max(1, int(interval_s * 1000))}"]
        self._p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)  # fmt: skip
        self.latest = 0
        self._t = threading.Thread(target=self._read, name="gpu-memory", daemon=True)
        self._t.start()

    def _read(self) -> None:
        batch: list[int] = []
        for line in self._p.stdout:  # one line per GPU per reading
            try:
                batch.append(int(line.strip()))
            except ValueError:
                continue
            if len(batch) == self._gpus:
                self.latest, batch = sum(batch), []

    def __call__(self) -> int:
        return self.latest

    def close(self) -> None:
        self._p.kill()
        self._p.wait()


class PhasePeaks:
    """The lowest and highest readings of `probe` (MiB) per named phase: `with
    peaks.phase("train"): ...`, then `take()` gives {phase: (low, peak)} of the phases since the
    last take. A colocated engine's release shows as the train phase's low below the rollout's."""

    def __init__(self, probe: Callable[[], int], interval_s: float = INTERVAL_S):
        self._probe, self._interval = probe, interval_s
        self._phase: str | None = None
        self._peaks: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="phase-peaks", daemon=True)
        self._t.start()

    def _read(self) -> None:
        value = self._probe()
        with self._lock:
            if self._phase is not None:
                low, peak = self._peaks.get(self._phase, (value, value))
                self._peaks[self._phase] = (min(low, value), max(peak, value))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._read()
            except Exception:  # a failed reading loses one sample, never the run
                continue

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phase = name
        self._read()
        try:
            yield
        finally:
            self._read()
            with self._lock:
                self._phase = None

    def take(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            out, self._peaks = self._peaks, {}
        return out

    def close(self) -> None:
        self._stop.set()
        self._t.join()
