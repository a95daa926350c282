"""Fixtures of the engine tests."""

from __future__ import annotations

import exact_and_stock as pair
import pytest


@pytest.fixture(scope="session")
def exact_and_stock(tiny_checkpoint, torchrun, tmp_path_factory, compile_cache) -> dict:
    """One exact and one stock engine, then one trainer job, for the routing and `--bisect`
    checks (exact_and_stock.run)."""
    work = tmp_path_factory.mktemp("exact-and-stock")
    return pair.run(tiny_checkpoint, torchrun, work, compile_cache)
