"""Pinned upstream archives: read the pin, download once into build/, verify sha256, unpack."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import tomllib
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from onpolicy.upstream.errors import UpstreamError

SIMPLE_INDEX = os.environ.get("ONPOLICY_PYPI_SIMPLE", "https://pypi.org/simple")


@dataclass(frozen=True, kw_only=True, slots=True)
class Pin:
    """One pinned upstream archive."""

    name: str
    """Series name, e.g. `megatron-lm`; also the folder under patches/ and build/upstream/."""
    package: str
    """PyPI project name."""
    version: str
    """Upstream version this pin is for."""
    archive: str
    """Which archive of that version: `sdist`, `cp311`, `cp312`."""
    file: str
    """Exact file name on PyPI."""
    sha256: str
    """Expected sha256 of the file; anything else is refused."""


def load_pin(root: Path, name: str, version: str | None = None, archive: str | None = None) -> Pin:
    """The pin for `name` at `version` (default: the pinned one) and `archive`."""
    path = root / "third_party" / name / "upstream.toml"
    if not path.is_file():
        known = sorted(p.name for p in (root / "third_party").iterdir() if p.is_dir())
        raise UpstreamError(f"no upstream named {name!r}: {path} is missing (known: {known})")
    data = tomllib.loads(path.read_text())
    version = version or data["version"]
    archive = archive or data["archive"]
    files = data.get("files", {})
    if version not in files:
        raise UpstreamError(
            f'{name} {version} is not pinned in {path}: add a [files."{version}"] entry with '
            f"its file name and sha256 (pinned versions: {sorted(files)})"
        )
    if archive not in files[version]:
        raise UpstreamError(
            f"{name} {version} has no pinned {archive!r} archive in {path} "
            f"(pinned: {sorted(files[version])})"
        )
    entry = files[version][archive]
    return Pin(
        name=name,
        package=data["package"],
        version=version,
        archive=archive,
        file=entry["file"],
        sha256=entry["sha256"],
    )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pypi_url(pin: Pin) -> str:
    req = urllib.request.Request(
        f"{SIMPLE_INDEX}/{pin.package}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            index = json.load(r)
    except OSError as e:
        raise UpstreamError(f"cannot read the PyPI index for {pin.package}: {e}") from e
    for f in index.get("files", []):
        if f["filename"] == pin.file:
            return f["url"]
    raise UpstreamError(f"{pin.file} is not listed on {SIMPLE_INDEX}/{pin.package}/")


def fetch(root: Path, pin: Pin) -> Path:
    """The verified archive under build/downloads/, downloading it if needed.

    A file whose sha256 differs from the pin is refused and removed from the cache; nothing is
    unpacked from it.
    """
    cache = root / "build" / "downloads"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / pin.file
    if not dest.exists():
        url = _pypi_url(pin)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{pin.file}.")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as r:
                shutil.copyfileobj(r, out)
            _verify(Path(tmp), pin)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        try:
            _verify(dest, pin)
        except UpstreamError:
            dest.unlink()
            raise
    return dest


def _verify(path: Path, pin: Pin) -> None:
    got = sha256_of(path)
    if got != pin.sha256:
        raise UpstreamError(
            f"sha256 mismatch for {pin.file}: pinned {pin.sha256}, got {got}; "
            "refusing to use it (nothing was unpacked)"
        )


def unpack(archive: Path, dest: Path) -> None:
    """Unpack an sdist (dropping its top folder) or a wheel into the empty folder `dest`."""
    dest.mkdir(parents=True, exist_ok=False)
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
        return
    with tarfile.open(archive) as t:
        members = t.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise UpstreamError(f"{archive.name}: expected one top-level folder, got {sorted(top)}")
        prefix = top.pop() + "/"
        for m in members:
            if not m.name.startswith(prefix):
                continue
            m.name = m.name[len(prefix) :]
            t.extract(m, dest, filter="data")
