"""A patch series on disk: the ordered `series` list plus one format-patch file per concern."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from onpolicy.upstream import covered_by
from onpolicy.upstream.errors import UpstreamError

REQUIRED_HEADERS = ("Subject:", "Why:", "Upstream-Status:", "Covered-By:")
UPSTREAM_STATUS = re.compile(
    r"^Upstream-Status: (not-needed-upstream|to-propose|proposed \S+|backport \S+)$"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """The patches of one upstream, in order."""

    name: str
    """Series name, e.g. `megatron-lm`."""
    root: Path
    """The repo root, against which Covered-By paths resolve."""
    folder: Path
    """patches/<name>/."""
    patches: tuple[Path, ...]
    """Patch files in apply order, as listed in `series`."""


def load_series(root: Path, name: str) -> Series:
    folder = root / "patches" / name
    listing = folder / "series"
    if not listing.is_file():
        raise UpstreamError(f"no patch series for {name!r}: {listing} is missing")
    names = [
        line.strip()
        for line in listing.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return Series(name=name, root=root, folder=folder, patches=tuple(folder / n for n in names))


def slug(subject: str) -> str:
    """The file name a subject line gives: `fix: Allow X` -> `fix_allow_x.patch`."""
    s = re.sub(r"[^a-z0-9]+", "_", subject.lower()).strip("_")
    return s[:72].rstrip("_") + ".patch"


def lint(series: Series) -> list[str]:
    """Every rule the series breaks, one message each (empty when clean)."""
    problems: list[str] = []
    names = [p.name for p in series.patches]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{series.name}/series: {dup} is listed more than once")
    on_disk = {p.name for p in series.folder.glob("*.patch")}
    for missing in sorted(set(names) - on_disk):
        problems.append(f"{series.name}/series lists {missing}, which does not exist")
    for extra in sorted(on_disk - set(names)):
        problems.append(f"{series.name}/{extra} is not listed in {series.name}/series")
    for p in series.patches:
        if p.exists():
            problems += _lint_patch(series.name, p, series.root)
    return problems


def _lint_patch(name: str, path: Path, root: Path) -> list[str]:
    problems = []
    text = path.read_text()
    head, _, body = text.partition("\ndiff --git ")
    lines = head.splitlines()
    for h in REQUIRED_HEADERS:
        if not any(line.startswith(h) for line in lines):
            problems.append(f"{name}/{path.name}: missing header line {h!r}")
    for i, line in enumerate(lines):
        if line.startswith("Subject:"):
            # format-patch folds long subjects onto indented continuation lines.
            for more in lines[i + 1 :]:
                if not more.startswith(" "):
                    break
                line += more
        if line.startswith("Upstream-Status:") and not UPSTREAM_STATUS.match(line):
            problems.append(
                f"{name}/{path.name}: bad {line!r}; use not-needed-upstream, to-propose, "
                "proposed <link> or backport <ref>"
            )
        if line.startswith("Subject:"):
            want = slug(re.sub(r"^Subject: (\[PATCH[^\]]*\] )?", "", line))
            if want != path.name:
                problems.append(f"{name}/{path.name}: file name should be {want} (from Subject)")
    covered = covered_by.header_value(lines)
    if covered is not None:
        problems += [f"{name}/{path.name}: {p}" for p in covered_by.problems(root, covered)]
    for i, line in enumerate(text.splitlines(), 1):
        added = line.startswith("+") and not line.startswith("+++")
        in_head = i <= len(lines)
        if (added or in_head) and line != line.rstrip():
            problems.append(f"{name}/{path.name}:{i}: trailing whitespace")
    if not body:
        problems.append(f"{name}/{path.name}: contains no diff")
    return problems
