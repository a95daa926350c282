"""Benchmarks whose tables live in docs/benchmarks.md; each runs as `python -m onpolicy.bench.X`."""

import subprocess
from pathlib import Path


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[3]
    cmd = ["git", "-C", str(root), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def commit() -> str:
    """The short hash of the checkout the benchmark runs from, "+dirty" with local changes under
    integration/; "unknown" outside a git checkout. Recorded with every table."""
    try:
        rev = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "integration")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")
