"""The committed series themselves: they lint clean, re-export byte-identically, and apply
as one commit per patch onto the pinned upstreams (downloaded once into build/, sha256-checked).
Patches that no engine test exercises in the test venv are covered here.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from onpolicy.upstream import tree
from onpolicy.upstream.cli import NAMES, check
from onpolicy.upstream.series import load_series

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", NAMES)
def test_series_checks_clean(name):
    assert check(ROOT, name) == []


@pytest.mark.parametrize("name", NAMES)
def test_applied_tree_has_one_commit_per_patch(name):
    work = tree.apply(ROOT, name)
    subjects = tree.git(work, "log", "--reverse", "--format=%s", f"{tree.BASE_TAG}..HEAD")
    series = load_series(ROOT, name)
    assert len(subjects.stdout.splitlines()) == len(series.patches) > 0
    for patch in series.patches:
        head = patch.read_text().split("\ndiff --git ", 1)[0]
        assert "\nWhy: " in head and "\nUpstream-Status: " in head and "\nCovered-By: " in head


NO_TRITON = """
import sys
sys.modules["triton"] = None  # every `import triton` now raises ImportError
import megatron.core
from megatron.core.transformer.moe.ops import paged_stash
from megatron.core.utils import null_decorator
assert paged_stash.triton.jit is null_decorator
"""


def import_without_triton(tree_root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree_root), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", NO_TRITON], capture_output=True, text=True, env=env, cwd=tree_root
    )


def test_megatron_imports_without_triton(tmp_path):
    """The test venv has triton, so only this covers the fallback of the triton patch."""
    work = tree.apply(ROOT, "megatron-lm")
    p = import_without_triton(work)
    assert p.returncode == 0, p.stderr[-4000:]
    # Control: the unpatched megatron.core does not import without triton.
    base = tmp_path / "base"
    base.mkdir()
    archive = tree.git(work, "archive", tree.BASE_TAG, "megatron", text=False).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(base, filter="data")
    p = import_without_triton(base)
    assert p.returncode != 0 and "import of triton halted" in p.stderr, p.stderr[-4000:]
