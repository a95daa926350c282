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


def write_section(path: Path, heading: str, text: str) -> None:
    """Put `text` (starting with `heading`) in place of the file's `heading` section, or at the
    end when there is none, so that a re-run updates a benchmark's section instead of adding
    another."""
    lines = path.read_text().splitlines() if path.exists() else []
    if heading in lines:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))  # fmt: skip
        lines[start:end] = [*text.splitlines(), *([""] if end < len(lines) else [])]
    else:
        lines += ["", *text.splitlines()]
    path.write_text("\n".join(lines) + "\n")
