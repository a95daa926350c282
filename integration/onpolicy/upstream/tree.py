"""Patched trees under build/upstream/<name>/: apply, export, rebase, status.

A tree is a git repo: one base commit holding the pristine upstream, then one commit per patch.
Commits carry a fixed identity and date, so export is deterministic.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import Pin, fetch, load_pin, unpack
from onpolicy.upstream.series import Series, load_series, slug

MARKER = ".onpolicy-applied"
BASE_TAG = "upstream-base"
IDENTITY = {
    "GIT_AUTHOR_NAME": "onpolicy",
    "GIT_AUTHOR_EMAIL": "onpolicy@localhost",
    "GIT_COMMITTER_NAME": "onpolicy",
    "GIT_COMMITTER_EMAIL": "onpolicy@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
FIXED_DATE = "Date: Sat, 1 Jan 2000 00:00:00 +0000"
FORMAT_PATCH = [
    "format-patch",
    "--zero-commit",
    "--no-stat",
    "--full-index",
    "--no-signature",
    "--keep-subject",
    "--stdout",
]


def git(
    cwd: Path, *args: str, check: bool = True, text: bool = True
) -> subprocess.CompletedProcess:
    env = {**os.environ, **IDENTITY, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    p = subprocess.run(["git", *args], cwd=cwd, env=env, text=text, capture_output=True)
    if check and p.returncode != 0:
        raise UpstreamError(f"git {' '.join(args)} failed in {cwd}:\n{p.stdout}{p.stderr}")
    return p


def series_key(pin: Pin, series: Series) -> str:
    """Hash of the pin and every patch byte: a tree with this key needs no rebuild."""
    h = hashlib.sha256(f"{pin.file}:{pin.sha256}\n".encode())
    for p in series.patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _init_base(archive: Path, dest: Path, pin: Pin) -> None:
    unpack(archive, dest)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "config", "core.autocrlf", "false")
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "--no-verify", "-m", f"upstream: {pin.package} {pin.version}")
    git(dest, "tag", BASE_TAG)


def _am_failure(patch: Path, output: str) -> str:
    where = re.findall(r"patch failed: (\S+):(\d+)", output)
    files = re.findall(r"error: (\S+): (does not exist in index|No such file or directory)", output)
    if where:
        loc = ", ".join(f"{f} (hunk at line {n})" for f, n in where)
    elif files:
        loc = ", ".join(f"{f} (file missing)" for f, _ in files)
    else:
        loc = "the patch itself (corrupt or not a patch)"
    detail = "\n".join(line for line in output.splitlines() if line.startswith("error:"))
    return f"patch {patch.name} does not apply cleanly: {loc}\n{detail}".rstrip()


def apply(root: Path, name: str, *, force: bool = False) -> Path:
    """Build build/upstream/<name>/ from the pin and the series, strictly (no fuzz).

    Builds in a temporary sibling and renames it into place, marker last, so a failure leaves
    the previous tree (if any) untouched and no half-patched one.
    """
    pin, series = load_pin(root, name), load_series(root, name)
    dest = root / "build" / "upstream" / name
    key = series_key(pin, series)
    marker = dest / MARKER
    recorded = marker.read_text().split() if marker.is_file() else []
    if not force and recorded[:1] == [key]:
        return dest
    if not force and (dest / ".git").is_dir():
        unsaved = _unsaved_work(dest, series, recorded[1] if len(recorded) > 1 else None)
        if unsaved:
            raise UpstreamError(
                f"refusing to rebuild {dest}: it holds work the series does not have "
                f"({'; '.join(unsaved)}). Commit and `export {name}` it, or rerun apply "
                "with --force to discard it"
            )
    archive = fetch(root, pin)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{name}."))
    try:
        work = tmp / "tree"
        _init_base(archive, work, pin)
        for patch in series.patches:
            if not patch.is_file():
                raise UpstreamError(f"{name}/series lists {patch.name}, which does not exist")
            p = git(work, "am", "-q", "--keep-cr", "--committer-date-is-author-date",
                    str(patch), check=False)  # fmt: skip
            if p.returncode != 0:
                raise UpstreamError(_am_failure(patch, p.stdout + p.stderr))
        (work / ".git" / "info" / "exclude").write_text(f"{MARKER}\n")
        old = None
        if dest.exists():
            old = tmp / "old"
            os.replace(dest, old)
        head = git(work, "rev-parse", "HEAD").stdout.strip()
        os.replace(work, dest)
        (dest / f"{MARKER}.tmp").write_text(f"{key}\n{head}\n")
        os.replace(dest / f"{MARKER}.tmp", marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _unsaved_work(tree: Path, series: Series, applied_head: str | None) -> list[str]:
    """What a rebuild of `tree` would lose: uncommitted edits, commits not in the series."""
    lost = []
    dirty = [line[3:] for line in git(tree, "status", "--porcelain").stdout.splitlines()]
    if dirty:
        lost.append(
            f"uncommitted changes in {', '.join(dirty[:5])}" + (" ..." if len(dirty) > 5 else "")
        )
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if applied_head is not None and head != applied_head:
        on_disk = {p.name: p.read_bytes() for p in series.patches if p.is_file()}
        if render(tree) != on_disk:
            lost.append("commits made after apply that are not exported")
    return lost


def render(tree: Path) -> dict[str, bytes]:
    """Patch files for every commit after the base: {file name: bytes}, in order."""
    revs = git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").stdout.split()
    out: dict[str, bytes] = {}
    for rev in revs:
        text = git(tree, *FORMAT_PATCH, "-1", rev).stdout
        text = re.sub(r"^Date: .*$", FIXED_DATE, text, count=1, flags=re.M)
        subject = git(tree, "log", "-1", "--format=%s", rev).stdout.strip()
        fname = slug(subject)
        if fname in out:
            raise UpstreamError(f"two commits share the subject {subject!r}; make them distinct")
        out[fname] = text.encode()
    return out


def export(root: Path, name: str) -> list[str]:
    """Write the commits of build/upstream/<name>/ back to patches/<name>/, atomically."""
    tree = root / "build" / "upstream" / name
    if not (tree / ".git").is_dir():
        raise UpstreamError(f"{tree} is not a patched tree; run `onpolicy upstream apply {name}`")
    rendered = render(tree)
    folder = root / "patches" / name
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}."))
    staging.chmod(0o755)  # mkdtemp makes it private; the committed folder must not be
    try:
        for fname, data in rendered.items():
            (staging / fname).write_bytes(data)
        (staging / "series").write_text("".join(f"{f}\n" for f in rendered))
        old = folder.parent / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return list(rendered)


def reexport_diff(root: Path, name: str) -> list[str]:
    """Apply the series in a scratch tree and re-export: names of files that differ."""
    series = load_series(root, name)
    pin = load_pin(root, name)
    archive = fetch(root, pin)
    scratch = Path(tempfile.mkdtemp(prefix=f"onpolicy-check-{name}-"))
    try:
        work = scratch / "tree"
        _init_base(archive, work, pin)
        for patch in series.patches:
            p = git(work, "am", "-q", "--keep-cr", str(patch), check=False)
            if p.returncode != 0:
                raise UpstreamError(_am_failure(patch, p.stdout + p.stderr))
        rendered = render(work)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    diffs = [p.name for p in series.patches if rendered.get(p.name) != p.read_bytes()]
    diffs += [f for f in rendered if f not in {p.name for p in series.patches}]
    return diffs


@dataclass(frozen=True, slots=True)
class RebaseRow:
    patch: str
    result: str
    """clean / offset / conflict."""
    files: tuple[str, ...]


def rebase(root: Path, name: str, version: str) -> tuple[Path, list[RebaseRow]]:
    """Apply the series onto another pinned upstream version with a 3-way merge.

    The result is build/rebase/<name>-<version>/, branch `rebase`: one commit per patch. A
    conflicting patch is committed with its conflict markers, for the engineer to finish.
    """
    base_pin = load_pin(root, name)
    pin = load_pin(root, name, version, base_pin.archive)
    series = load_series(root, name)
    archive = fetch(root, pin)
    dest = root / "build" / "rebase" / f"{name}-{version}"
    shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _init_base(archive, dest, pin)
    # The 3-way merge needs the patches' preimage blobs: import the pinned base tree as well.
    old_archive = fetch(root, base_pin)
    scratch = Path(tempfile.mkdtemp(prefix=f"onpolicy-rebase-{name}-"))
    try:
        _init_base(old_archive, scratch / "old", base_pin)
        git(dest, "fetch", "-q", str(scratch / "old"), f"refs/tags/{BASE_TAG}:refs/tags/old-base")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    git(dest, "checkout", "-q", "-b", "rebase")
    rows = []
    for patch in series.patches:
        check = git(dest, "apply", "--check", "-v", str(patch), check=False)
        files = tuple(re.findall(r"^diff --git a/(\S+)", patch.read_text(), flags=re.M))
        if check.returncode == 0:
            result = "offset" if "offset" in check.stdout + check.stderr else "clean"
            git(dest, "am", "-q", "--keep-cr", str(patch))
            rows.append(RebaseRow(patch.name, result, files))
            continue
        p = git(dest, "am", "-q", "-3", "--keep-cr", str(patch), check=False)
        if p.returncode == 0:
            rows.append(RebaseRow(patch.name, "offset", files))
            continue
        conflicted = (
            tuple(git(dest, "diff", "--name-only", "--diff-filter=U").stdout.split()) or files
        )
        # Commit the conflict markers under the patch's own message, for the engineer to fix.
        git(dest, "add", "-A")
        git(dest, "am", "--continue", check=False)
        if (dest / ".git" / "rebase-apply").exists():
            git(dest, "am", "--skip", check=False)
        rows.append(RebaseRow(patch.name, "conflict", conflicted))
    return dest, rows


def status(root: Path, name: str) -> str:
    pin, series = load_pin(root, name), load_series(root, name)
    tree = root / "build" / "upstream" / name
    marker = tree / MARKER
    if not marker.is_file():
        state = "not applied"
    elif marker.read_text().split()[:1] == [series_key(pin, series)]:
        dirty = git(tree, "status", "--porcelain").stdout.strip()
        ahead = git(tree, "rev-list", "--count", f"{BASE_TAG}..HEAD").stdout.strip()
        state = f"applied ({ahead} commits{', uncommitted edits' if dirty else ''})"
    else:
        state = "stale (pin or patches changed since apply)"
    n = len(series.patches)
    return f"{name}: {pin.package} {pin.version} [{pin.archive}] {n} patches, {state}"
