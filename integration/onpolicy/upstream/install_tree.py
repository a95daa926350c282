"""Turn a patched tree (build/upstream/<name>/) into something pip installs; print its path.

- An sdist pin (megatron-core): a clean export of the tree's HEAD under build/src/, so pip's
  in-tree build never dirties the patched git tree.
- A wheel pin (sglang ships no sdist; its series applies to the unpacked wheel): the patched
  tree zipped back under the pinned wheel's file name, RECORD rewritten to match the patched
  files, so pip installs and uninstalls it like any wheel.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from onpolicy.upstream.cli import find_root
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import Pin, load_pin
from onpolicy.upstream.tree import MARKER, git


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def installable(root: Path, name: str) -> Path:
    """The path to hand to `pip install` for the applied tree of `name`."""
    pin = load_pin(root, name)
    tree = root / "build" / "upstream" / name
    if not (tree / MARKER).is_file():
        raise UpstreamError(f"{tree} is not an applied tree; run `onpolicy upstream apply {name}`")
    return repack(root, pin, tree) if pin.file.endswith(".whl") else source_copy(root, name, tree)


def source_copy(root: Path, name: str, tree: Path) -> Path:
    """HEAD of the patched tree, exported to build/src/<name>/ (replaced atomically)."""
    out = root / "build" / "src"
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{name}."))
    try:
        archive = git(tree, "archive", "--format=tar", "HEAD", text=False).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            t.extractall(tmp, filter="data")
        dest = out / name
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def repack(root: Path, pin: Pin, tree: Path) -> Path:
    dist_info = [d for d in tree.glob("*.dist-info") if d.is_dir()]
    if len(dist_info) != 1:
        raise UpstreamError(f"{tree}: expected one *.dist-info folder, got {len(dist_info)}")
    record_name = f"{dist_info[0].name}/RECORD"
    out_dir = root / "build" / "wheels"
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / pin.file
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{pin.file}.")
    os.close(fd)
    try:
        records = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(tree.rglob("*")):
                rel = path.relative_to(tree).as_posix()
                if path.is_dir() or rel.startswith(".git/") or rel in (MARKER, record_name):
                    continue
                data = path.read_bytes()
                z.writestr(rel, data)
                records.append((rel, _digest(data), str(len(data))))
            records.append((record_name, "", ""))
            # csv, as the wheel spec says: some sglang file names contain commas.
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(records)
            z.writestr(record_name, buf.getvalue())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


if __name__ == "__main__":
    try:
        print(installable(find_root(), sys.argv[1]))
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
