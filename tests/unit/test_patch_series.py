"""The committed series themselves: they lint clean, re-export byte-identically, and apply
as one commit per patch onto the pinned upstreams (downloaded once into build/, sha256-checked).
"""

from __future__ import annotations

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
