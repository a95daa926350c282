"""The patch-series tool on a synthetic upstream: round trip, strict failures, pins, rebase.

The archives are placed in build/downloads/ of a scratch repo root, where `fetch` finds them,
so these tests exercise the real code paths (sha256 check, unpack, git am, export) offline.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from onpolicy.upstream import tree
from onpolicy.upstream.cli import check, main
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.series import lint, load_series

LINES = [f"line {i}\n" for i in range(1, 41)]
DEMO_TESTS = """
import pytest


def helper():
    pass


@pytest.mark.parametrize("n", [1, 2], ids=["one", "two"])
def test_demo(n):
    assert n


class TestGroup:
    def test_member(self):
        pass
"""
DEMO_NOXFILE = """
import nox


@nox.session(python="3.11")
def build(session):
    pass
"""


def make_sdist(path: Path, version: str, files: dict[str, str]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"demo-{version}/{name}")
            info.size, info.mtime = len(data), 0
            t.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def make_root(tmp_path: Path, versions: dict[str, dict[str, str]]) -> Path:
    root = tmp_path / "repo"
    (root / "patches" / "demo").mkdir(parents=True)
    (root / "third_party" / "demo").mkdir(parents=True)
    (root / "build" / "downloads").mkdir(parents=True)
    (root / "patches" / "demo" / "series").write_text("")
    (root / "tests").mkdir()
    (root / "tests" / "test_demo.py").write_text(DEMO_TESTS)
    (root / "noxfile.py").write_text(DEMO_NOXFILE)
    pins = []
    for version, files in versions.items():
        fname = f"demo-{version}.tar.gz"
        sha = make_sdist(root / "build" / "downloads" / fname, version, files)
        pins.append(f'[files."{version}"]\nsdist = {{ file = "{fname}", sha256 = "{sha}" }}\n')
    first = next(iter(versions))
    (root / "third_party" / "demo" / "upstream.toml").write_text(
        f'name = "demo"\npackage = "demo"\nversion = "{first}"\narchive = "sdist"\n' + "".join(pins)
    )
    return root


def commit(work: Path, subject: str, edit) -> None:
    edit(work)
    msg = (
        f"{subject}\n\nWhy: a test change.\nUpstream-Status: not-needed-upstream\n"
        "Covered-By: tests/test_demo.py::test_demo\n"
    )
    tree.git(work, "commit", "-q", "-a", "-m", msg)


def with_two_patches(tmp_path: Path) -> Path:
    root = make_root(tmp_path, {"1.0": {"a.txt": "".join(LINES), "b.txt": "hello\n"}})
    work = tree.apply(root, "demo")

    def edit_a(w):
        (w / "a.txt").write_text("".join(LINES).replace("line 20\n", "line twenty\n"))

    commit(work, "fix: Change line twenty", edit_a)
    commit(work, "feat: Greet the world", lambda w: (w / "b.txt").write_text("hello world\n"))
    assert tree.export(root, "demo") == [
        "fix_change_line_twenty.patch",
        "feat_greet_the_world.patch",
    ]
    return root


def test_round_trip_is_byte_identical(tmp_path):
    root = with_two_patches(tmp_path)
    exported = {p.name: p.read_bytes() for p in (root / "patches/demo").iterdir()}
    assert check(root, "demo") == []
    work = tree.apply(root, "demo", force=True)
    log = tree.git(work, "log", "--format=%s").stdout.splitlines()
    assert log == ["feat: Greet the world", "fix: Change line twenty", "upstream: demo 1.0"]
    tree.export(root, "demo")
    assert {p.name: p.read_bytes() for p in (root / "patches/demo").iterdir()} == exported
    text = exported["fix_change_line_twenty.patch"].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Date: Sat, 1 Jan 2000 00:00:00 +0000" in text and "Why: a test change." in text


def test_apply_is_cached_on_the_inputs_hash(tmp_path):
    root = with_two_patches(tmp_path)
    work = tree.apply(root, "demo", force=True)
    head = tree.git(work, "rev-parse", "HEAD").stdout
    (work / "b.txt").write_text("local edit\n")
    tree.apply(root, "demo")  # unchanged inputs: the tree (and the edit) is kept
    assert (work / "b.txt").read_text() == "local edit\n"
    assert tree.git(work, "rev-parse", "HEAD").stdout == head


def test_corrupt_patch_names_patch_file_and_hunk_and_keeps_old_tree(tmp_path):
    root = with_two_patches(tmp_path)
    work = tree.apply(root, "demo", force=True)
    before = tree.git(work, "rev-parse", "HEAD").stdout
    p = root / "patches/demo/fix_change_line_twenty.patch"
    p.write_text(p.read_text().replace(" line 19\n", " line nineteen\n"))
    with pytest.raises(UpstreamError) as e:
        tree.apply(root, "demo")
    msg = str(e.value)
    assert "fix_change_line_twenty.patch" in msg and "a.txt (hunk at line 17)" in msg
    assert tree.git(work, "rev-parse", "HEAD").stdout == before
    assert [d.name for d in (root / "build/upstream").iterdir()] == ["demo"]


def test_garbage_patch_is_refused(tmp_path):
    root = with_two_patches(tmp_path)
    (root / "patches/demo/feat_greet_the_world.patch").write_text("not a patch\n")
    with pytest.raises(UpstreamError, match="feat_greet_the_world.patch does not apply"):
        tree.apply(root, "demo", force=True)


def test_wrong_sha256_is_refused_and_nothing_unpacked(tmp_path):
    root = make_root(tmp_path, {"1.0": {"a.txt": "x\n"}})
    archive = root / "build/downloads/demo-1.0.tar.gz"
    archive.write_bytes(archive.read_bytes() + b"tampered")
    with pytest.raises(UpstreamError, match="sha256 mismatch for demo-1.0.tar.gz"):
        tree.apply(root, "demo")
    assert not (root / "build/upstream").exists() or not any((root / "build/upstream").iterdir())
    assert not archive.exists()  # the bad file is dropped from the cache


def test_unpinned_version_is_refused(tmp_path):
    root = make_root(tmp_path, {"1.0": {"a.txt": "x\n"}})
    with pytest.raises(
        UpstreamError, match=r"demo 9.9 is not pinned .* \(pinned versions: \[.1.0.\]\)"
    ):
        tree.rebase(root, "demo", "9.9")


def test_lint_rules(tmp_path):
    root = with_two_patches(tmp_path)
    folder = root / "patches/demo"
    p = folder / "fix_change_line_twenty.patch"
    p.write_text(
        p.read_text().replace("Why: a test change.\n", "").replace("+line twenty", "+line twenty ")
    )
    (folder / "stray.patch").write_text("x")
    (folder / "series").write_text((folder / "series").read_text() + "feat_greet_the_world.patch\n")
    problems = "\n".join(lint(load_series(root, "demo")))
    assert "missing header line 'Why:'" in problems
    assert "trailing whitespace" in problems
    assert "stray.patch is not listed" in problems
    assert "feat_greet_the_world.patch is listed more than once" in problems


def test_check_catches_a_non_canonical_export(tmp_path):
    root = with_two_patches(tmp_path)
    p = root / "patches/demo/feat_greet_the_world.patch"
    p.write_text(p.read_text().replace("Date: Sat, 1 Jan 2000", "Date: Sun, 2 Jan 2000"))
    (problem,) = check(root, "demo")
    assert problem.startswith("demo/feat_greet_the_world.patch: re-export differs")


def test_rebase_table(tmp_path, capsys):
    shifted = ["new top\n"] * 3 + LINES  # same text three lines lower: an offset
    root = make_root(
        tmp_path,
        {
            "1.0": {"a.txt": "".join(LINES), "b.txt": "hello\n"},
            "2.0": {"a.txt": "".join(shifted), "b.txt": "goodbye\n"},
        },
    )
    work = tree.apply(root, "demo")

    def edit_a(w):
        (w / "a.txt").write_text("".join(LINES).replace("line 20\n", "line twenty\n"))

    commit(work, "fix: Change line twenty", edit_a)
    commit(work, "feat: Greet the world", lambda w: (w / "b.txt").write_text("hello world\n"))
    tree.export(root, "demo")
    rc = main(["--root", str(root), "rebase", "demo", "2.0"])
    out = capsys.readouterr().out
    assert rc == 1  # a conflict is left for the engineer
    assert "fix_change_line_twenty.patch  offset    a.txt" in out
    assert "feat_greet_the_world.patch    conflict  b.txt" in out
    dest = root / "build/rebase/demo-2.0"
    log = tree.git(dest, "log", "--format=%s", "rebase").stdout.splitlines()
    assert log[-1] == "upstream: demo 2.0" and "fix: Change line twenty" in log
    assert "line twenty" in (dest / "a.txt").read_text()


def test_cli_status_and_module_entry(tmp_path):
    root = with_two_patches(tmp_path)
    tree.apply(root, "demo", force=True)
    integration = str(Path(__file__).resolve().parents[2] / "integration")
    p = subprocess.run(
        [sys.executable, "-m", "onpolicy.upstream", "--root", str(root), "status", "demo"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": integration},
    )
    assert p.returncode == 0, p.stderr
    assert "demo: demo 1.0 [sdist] 2 patches, applied (2 commits)" in p.stdout


def test_rebuild_refuses_to_drop_unexported_work(tmp_path):
    root = with_two_patches(tmp_path)
    work = tree.apply(root, "demo", force=True)
    folder = root / "patches/demo"
    # The series changes under the tree (a pull), while the tree holds local work.
    p = folder / "feat_greet_the_world.patch"
    p.write_text(p.read_text().replace("Why: a test change.", "Why: a changed reason."))
    (work / "a.txt").write_text("local edit\n")
    with pytest.raises(UpstreamError, match=r"uncommitted changes in a.txt.*--force"):
        tree.apply(root, "demo")
    assert (work / "a.txt").read_text() == "local edit\n"  # nothing was lost
    tree.git(work, "commit", "-q", "-a", "-m", "feat: Local work\n\nWhy: x\n")
    with pytest.raises(UpstreamError, match="commits made after apply that are not exported"):
        tree.apply(root, "demo")
    tree.apply(root, "demo", force=True)  # the explicit discard
    assert "local edit" not in (work / "a.txt").read_text()


def test_rebuild_after_export_needs_no_force(tmp_path):
    root = with_two_patches(tmp_path)  # committed in the tree, then exported
    work = tree.apply(root, "demo")
    log = tree.git(work, "log", "--format=%s").stdout.splitlines()
    assert log[:2] == ["feat: Greet the world", "fix: Change line twenty"]


def with_covered_by(tmp_path: Path, value: str) -> Path:
    """The two-patch series with the Covered-By header of one patch replaced by `value`."""
    root = with_two_patches(tmp_path)
    p = root / "patches/demo/fix_change_line_twenty.patch"
    text = p.read_text()
    assert text.count("Covered-By: tests/test_demo.py::test_demo\n") == 1
    p.write_text(text.replace("Covered-By: tests/test_demo.py::test_demo\n", value))
    return root


def test_covered_by_missing_file_fails(tmp_path, capsys):
    root = with_covered_by(tmp_path, "Covered-By: tests/test_gone.py::test_demo (the fix)\n")
    (problem,) = check(root, "demo")
    assert problem == (
        "demo/fix_change_line_twenty.patch: Covered-By item "
        "'tests/test_gone.py::test_demo (the fix)': file tests/test_gone.py does not exist"
    )
    assert main(["--root", str(root), "check", "demo"]) == 1
    captured = capsys.readouterr()
    assert problem in captured.err and "demo: FAILED" in captured.out


def test_covered_by_missing_function_fails(tmp_path):
    root = with_covered_by(
        tmp_path, "Covered-By: tests/test_demo.py::test_demo, tests/test_demo.py::test_gone[one]\n"
    )
    (problem,) = check(root, "demo")
    assert problem == (
        "demo/fix_change_line_twenty.patch: Covered-By item "
        "'tests/test_demo.py::test_gone[one]': tests/test_demo.py defines no function test_gone"
    )


def test_covered_by_valid_header_passes(tmp_path):
    value = (
        "Covered-By: tests/test_demo.py::test_demo[two] (a note, with a comma),\n"
        " tests/test_demo.py::TestGroup::test_member, tests/test_demo.py,\n"
        " noxfile.py::build (a nox session)\n"
    )
    root = with_covered_by(tmp_path, value)
    assert check(root, "demo") == []  # lint clean and the re-export is still byte-identical


@pytest.mark.parametrize("param_id", ["[one]", "[two]", "[1-a.b]"])
def test_covered_by_accepts_a_param_id(tmp_path, param_id):
    root = with_covered_by(tmp_path, f"Covered-By: tests/test_demo.py::test_demo{param_id}\n")
    assert lint(load_series(root, "demo")) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tests/test_demo.py::helper", "tests/test_demo.py::helper is neither a test"),
        ("tests/test_demo.py::TestGone::test_member", "defines no class TestGone"),
        ("noxfile.py build session (a note)", "is malformed"),
        ("tests/test_demo.py::test_demo[one", "is malformed"),
        ("../outside.py", "../outside.py is not a path inside the repo"),
        ("tests", "tests is a folder, not a file"),
        ("", "Covered-By names no test"),
    ],
)
def test_covered_by_rejects(tmp_path, value, message):
    (tmp_path / "outside.py").write_text("def test_x():\n    pass\n")
    root = with_covered_by(tmp_path, f"Covered-By: {value}".rstrip() + "\n")
    problems = lint(load_series(root, "demo"))
    assert len(problems) == 1 and message in problems[0], problems
