"""Repack a patched unpacked-wheel tree (build/upstream/<name>/) as a wheel pip can install.

sglang ships no sdist, so its series applies to the unpacked wheel. Zipping the patched tree
back under the pinned wheel's file name lets `pip install --no-deps` install and uninstall it
like any wheel. RECORD is rewritten so its hashes match the patched files.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from onpolicy.upstream.cli import find_root
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import load_pin
from onpolicy.upstream.tree import MARKER


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(root: Path, name: str) -> Path:
    pin = load_pin(root, name)
    if not pin.file.endswith(".whl"):
        raise UpstreamError(f"{name} is pinned to {pin.file}, not a wheel; install it with pip")
    tree = root / "build" / "upstream" / name
    if not (tree / MARKER).is_file():
        raise UpstreamError(f"{tree} is not an applied tree; run `onpolicy upstream apply {name}`")
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
        print(repack(find_root(), sys.argv[1]))
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
