"""Files split into parts that travel separately, with a manifest that checks them on arrival.

A part is a folder `part-NN/` whose files take at most `cap` bytes. A file over the cap is cut
into numbered pieces, each in a part of its own, checked and joined again on arrival. Every part
also holds the same `manifest.json` (each file's name, version, sha256, size and pieces; 75 KB
for the GPU host's 164 files), so any part is self-describing and parts of two different
bundles are not mixed unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import sha256_of

CAP = 60 << 20
MANIFEST = "manifest.json"


def split(sizes: dict[str, int], cap: int = CAP) -> list[list[tuple[str, int, int]]]:
    """Parts of at most `cap` bytes, each a list of (file, start, length). A file over the cap is
    cut into pieces of `cap` bytes, each in a part of its own; the others are packed, largest
    first, into the first part with room."""
    if cap <= 0:
        raise UpstreamError(f"the part size must be positive, got {cap}")
    parts: list[list[tuple[str, int, int]]] = []
    room: list[int] = []
    for f in sorted(f for f in sizes if sizes[f] > cap):
        for start in range(0, sizes[f], cap):
            parts.append([(f, start, min(cap, sizes[f] - start))])
            room.append(0)
    for f in sorted((f for f in sizes if sizes[f] <= cap), key=lambda f: (-sizes[f], f)):
        i = next((i for i, r in enumerate(room) if r >= sizes[f]), None)
        if i is None:
            parts.append([])
            room.append(cap)
            i = len(parts) - 1
        parts[i].append((f, 0, sizes[f]))
        room[i] -= sizes[f]
    return parts


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """A file as it lies in a part: the whole file, or one piece of a file over the cap."""

    file: str
    part: int
    sha256: str
    size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Item:
    """One shipped file."""

    file: str
    """File name: a wheel, or the pinned megatron-core sdist."""
    name: str
    version: str
    sha256: str
    size: int
    series: str | None
    """The patch series the host applies to it (`sglang`, `megatron-lm`); None: installed as is."""
    pieces: tuple[Piece, ...]
    """Where it lies: whole in one part, or (over the cap) in numbered pieces, a part each."""


def part_dir(wheels: Path, part: int) -> Path:
    return wheels / f"part-{part:02d}"


def bundle(
    files: list[tuple[Path, str, str, str | None]], out: Path, *, cap: int = CAP, inputs: str = ""
) -> dict:
    """Copy (file, name, version, series) into out/part-NN/ by `split` and write the manifest to
    out/ and to every part; old parts are removed first."""
    sizes = {f.name: f.stat().st_size for f, *_ in files}
    src = {f.name: f for f, *_ in files}
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    pieces: dict[str, list[Piece]] = {f: [] for f in sizes}
    for k, part in enumerate(split(sizes, cap), 1):
        folder = part_dir(out, k)
        folder.mkdir(parents=True)
        for f, start, length in part:
            dest = folder / (f if length == sizes[f] else f"{f}.{start // cap:03d}")
            with src[f].open("rb") as r, dest.open("wb") as w:
                r.seek(start)
                w.write(r.read(length))
            pieces[f].append(Piece(file=dest.name, part=k, sha256=sha256_of(dest), size=length))
    items = [
        Item(
            file=f.name,
            name=name,
            version=version,
            sha256=sha256_of(f),
            size=sizes[f.name],
            series=series,
            pieces=tuple(pieces[f.name]),
        )
        for f, name, version, series in sorted(files, key=lambda t: t[0].name)
    ]
    parts = max((p.part for i in items for p in i.pieces), default=0)
    manifest = {
        "format": 1,
        "inputs": inputs,
        "cap": cap,
        "parts": parts,
        "items": [asdict(i) for i in items],
    }
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for folder in [out, *(part_dir(out, k) for k in range(1, manifest["parts"] + 1))]:
        (folder / MANIFEST).write_text(text)
    return json.loads(text)  # as a part's copy reads


def load_manifest(wheels: Path) -> dict:
    """The manifest, from `wheels` or any of its parts; every copy present must be the same."""
    copies = [
        p for p in [wheels / MANIFEST, *sorted(wheels.glob(f"part-*/{MANIFEST}"))] if p.is_file()
    ]
    if not copies:
        raise UpstreamError(
            f"no {MANIFEST} in {wheels} or its part-NN/ folders: carry the "
            "parts that `nox -s gpu-wheels` wrote"
        )
    texts = {p: p.read_text() for p in copies}
    if len(set(texts.values())) > 1:
        first = copies[0]
        other = next(p for p in copies if texts[p] != texts[first])
        raise UpstreamError(
            f"{first} and {other} differ: parts of two downloads are mixed; "
            "carry every part of one download"
        )
    return json.loads(texts[copies[0]])


def items(manifest: dict) -> list[Item]:
    return [
        Item(**{**i, "pieces": tuple(Piece(**p) for p in i["pieces"])}) for i in manifest["items"]
    ]


def verify(wheels: Path, chosen: list[Item], *, part: int | None = None) -> dict[str, list[Path]]:
    """Check every piece (of `part` only, if given) against the manifest, refusing at the first
    missing or different one, and the pieces of a file over the cap together against the whole
    file's sha256. Writes nothing. Returns each wholly present file's pieces, in order."""
    found = {}
    for it in chosen:
        pieces = [p for p in it.pieces if part is None or p.part == part]
        for pc in pieces:
            path = part_dir(wheels, pc.part) / pc.file
            if not path.is_file():
                raise UpstreamError(f"{path} is missing; carry part-{pc.part:02d}")
            _check(path, pc.sha256, sha256_of(path))
        if not pieces or len(pieces) < len(it.pieces):
            continue
        paths = [part_dir(wheels, pc.part) / pc.file for pc in it.pieces]
        if len(paths) > 1:
            h = hashlib.sha256()
            for path in paths:
                with path.open("rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 20), b""):
                        h.update(block)
            _check(Path(f"{paths[0].parent}/{it.file} (joined)"), it.sha256, h.hexdigest())
        found[it.file] = paths
    return found


def _check(path: Path, want: str, got: str) -> None:
    if got != want:
        raise UpstreamError(
            f"sha256 mismatch for {path}: manifest {want}, file {got}; refusing to install anything"
        )


def joined(pieces: list[Path], dest: Path) -> Path:
    """The file itself, or (pieces of a file over the cap) the pieces joined into `dest`, so the
    parts stay as they were carried."""
    if len(pieces) == 1:
        return pieces[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    with os.fdopen(fd, "wb") as w:
        for path in pieces:
            with path.open("rb") as r:
                shutil.copyfileobj(r, w)
    os.replace(tmp, dest)
    return dest


def summary(manifest: dict) -> str:
    """Totals, each part's file count and size, and the files cut into pieces."""
    its = items(manifest)
    mib = 1 << 20
    lines = [
        f"{len(its)} files ({sum(i.file.endswith('.whl') for i in its)} wheels), "
        f"{sum(i.size for i in its) / mib:.1f} MiB, {manifest['parts']} parts of at most "
        f"{manifest['cap'] / mib:.0f} MiB"
    ]
    for k in range(1, manifest["parts"] + 1):
        ps = [p for i in its for p in i.pieces if p.part == k]
        lines.append(f"  part-{k:02d}: {len(ps)} file(s), {sum(p.size for p in ps) / mib:.1f} MiB")
    lines += [
        f"  over the cap, cut into {len(i.pieces)} pieces in parts of their own: {i.file} "
        f"({i.size / mib:.1f} MiB)"
        for i in its
        if len(i.pieces) > 1
    ]
    return "\n".join(lines)
