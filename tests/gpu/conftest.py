"""How much of each GPU test went to Triton's compiler (in the pytest process: the e2e runs'
own processes are not counted), printed after the run with each test's wall time."""

from __future__ import annotations

import time

import pytest
from onpolicy.kernels.cuda.warmup import CompileLog

LOG = CompileLog()
WALL: dict[str, float] = {}
"""nodeid -> the test's wall seconds (its fixtures' setup included)."""


@pytest.fixture(autouse=True)
def _compile_time(request):
    t0 = time.perf_counter()
    with LOG.counting(request.node.nodeid):
        yield
    WALL[request.node.nodeid] = time.perf_counter() - t0


@pytest.fixture(scope="module", autouse=True)
def _free_the_gpu_after_each_module():
    """Hand the caching allocator's blocks back once a module is done: test_fullsize's in-process
    model alone leaves about 62 GiB cached, and later modules start trainers and engines in
    processes of their own, which SGLang sizes from the memory free as it starts."""
    yield
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    if not WALL:
        return
    seconds, compiles, hits = LOG.total()
    wall = sum(WALL.values())
    terminalreporter.write_line(
        f"triton compile: {seconds:.1f} s of {wall:.1f} s of GPU tests ({compiles} compiles, "
        f"{hits} kernels from the disk cache), in the pytest process"
    )
    ranked = sorted(LOG.by_label.items(), key=lambda kv: -kv[1][0])
    for nodeid, (s, n, h) in ranked[:15]:
        if n or h:
            terminalreporter.write_line(f"  {s:7.1f} s of {WALL.get(nodeid, 0.0):7.1f} s, "
                                        f"{int(n)} compiles, {int(h)} hits: {nodeid}")  # fmt: skip
