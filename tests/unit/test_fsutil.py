"""`onpolicy.fsutil.write_atomic`: a temporary sibling of its own, written and fsynced before the
rename, the folder fsynced after it; on failure the old content stays and no temporary is left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from onpolicy import fsutil
from onpolicy.fsutil import write_atomic


def test_the_data_is_synced_before_the_rename_and_the_rename_after_it(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    target = tmp_path / "config.json"
    write_atomic(target, "{}\n")
    assert target.read_text() == "{}\n"
    kinds = [(k, Path(p).name if k == "fsync" else p) for k, p in events]
    assert len(kinds) == 3, events
    (k0, tmp), rename, folder = kinds
    assert k0 == "fsync" and tmp.startswith(".config.json.tmp-"), events  # the data, then
    assert rename == ("rename", str(target)), events  # the rename, then
    assert folder == ("fsync", tmp_path.name), events  # the folder that holds the new name


def test_concurrent_writers_never_share_a_temporary(tmp_path, monkeypatch):
    """Two writers of one path in one process (same pid) each take their own temporary; the
    file ends as one writer's whole text."""
    names: list[str] = []
    real_open = os.open
    barrier = threading.Barrier(2)

    def opening(path, flags, mode=0o777):
        if ".tmp-" in str(path):
            names.append(str(path))
            barrier.wait(timeout=10)  # both temporaries exist at once
        return real_open(path, flags, mode)

    monkeypatch.setattr(fsutil.os, "open", opening)
    target = tmp_path / "metrics.json"
    texts = ["a" * 100_000, "b" * 100_000]
    threads = [threading.Thread(target=write_atomic, args=(target, t)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 2, names
    assert target.read_text() in texts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_text("1\n")

    def full_disk(fd, data):
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil, "_write_fd", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "2\n")
    assert target.read_text() == "1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
