"""Fixtures of the e2e tests."""

from __future__ import annotations

import cli_run
import pytest


@pytest.fixture(autouse=True)
def _no_run_left():
    """After every test (and a module's fixtures, on error), no `onpolicy e2e` run of it is
    left running."""
    yield
    cli_run.stop_all()
