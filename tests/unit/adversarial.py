"""Inputs on which a different reduction order shows, shared by the kernel property tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings
from onpolicy.bits import assert_bitwise, bitwise_equal, mismatch_report, n_differ  # noqa: F401

DTYPES = [torch.bfloat16, torch.float32]
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
"""Hypothesis settings for every property: reproducible in CI, no per-example deadline."""

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""cuda is marked gpu: run with -m gpu on the GPU machine; tests/conftest.py skips it elsewhere."""
CUDA = DEVICES[1:]
"""The cuda case alone: for negative controls about what the plain CUDA op does."""


def wide(
    *shape: int, seed: int, dtype=torch.float32, spread: int = 12, device: str = "cpu"
) -> torch.Tensor:
    """Normal mantissas times 2^e, e uniform in [-spread, spread): reordering a sum shows.
    Drawn on the CPU, then moved, so every device gets the same values."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread, shape, generator=g).float()
    return (torch.randn(*shape, generator=g) * torch.exp2(e)).to(dtype).to(device)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n inside, restored after (controls that run a
    library op pin it; thread-count tests sweep it)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def one_thread() -> contextlib.AbstractContextManager[None]:
    """Controls that run a library op pin the thread count (the default is the machine's)."""
    return num_threads(1)


Pairs = list[tuple[str, torch.Tensor, torch.Tensor]]
"""(what, one way, the other way): a harness's outputs that its property says are equal."""


def assert_holds(pairs: Pairs) -> None:
    for what, a, b in pairs:
        assert_bitwise(a, b, what)


def count_broken(pairs: Pairs) -> tuple[int, int, str]:
    """(differing elements, elements, one line per pair) over a harness's outputs."""
    per = [(what, n_differ(a, b), a.numel()) for what, a, b in pairs]
    lines = "; ".join(f"{what}: {d} of {n}" for what, d, n in per)
    return sum(d for _, d, _ in per), sum(n for _, _, n in per), lines
