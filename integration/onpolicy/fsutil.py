"""Durable file writes: fsync a path, write a file synced, write a file atomically; and the
exclusive lock a process holds on an output folder while it writes there.

`write_atomic` is the one way the package replaces a file that readers may see: the data goes
to a temporary sibling in the same folder, is fsynced, renamed over the target, and the folder
is fsynced so the rename survives a crash. A reader sees the old file or the new one, never a
part. `write_synced` is for files inside a folder that is itself published later by a rename
(a checkpoint's temporary folder), where the rename is what makes them visible.

Imports nothing from onpolicy, so every layer may use it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import IO

__all__ = ["LOCK_NAME", "FolderLocked", "fsync_path", "lock_folder", "write_atomic", "write_synced"]

LOCK_NAME = ".lock"
"""The lock file inside a locked folder (it holds the holder's pid)."""


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (a folder's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fd(fd: int, data: str | bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def write_synced(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o666) -> None:
    """Write `data` (str as UTF-8) to `path` in place, truncating it, and fsync the file.

    `mode` is the permission of a new file before the umask, as `open` uses it.
    """
    _write_fd(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), data)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o666) -> None:
    """Replace `path` with `data` (str as UTF-8) atomically and durably.

    A temporary sibling `.NAME.tmp-PID-RANDOM` in the same folder (a NAME that starts with a
    dot keeps its one dot) is written and fsynced, renamed over `path`, and the folder fsynced.
    On any failure the temporary is removed and `path` is as it was. `mode` is the permission
    of the new file before the umask, as `open` uses it (0o600 for a private file).
    """
    path = Path(path)
    hidden = path.name if path.name.startswith(".") else f".{path.name}"
    tmp = path.with_name(f"{hidden}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_fd(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class FolderLocked(OSError):
    """Another process holds the folder's lock."""


def lock_folder(folder: str | os.PathLike) -> IO[str]:
    """Take the exclusive lock of `folder` (created if missing) for as long as the returned file
    stays open (closing it, or the process ending, releases it); FolderLocked naming the
    holder's pid if another process has it. An advisory flock: every writer of a run folder
    takes it before its first write."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_NAME, "a+")  # noqa: SIM115 - the caller holds it open
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise FolderLocked(f"{folder} is locked by process {holder} (another run or convert "
                           "writes there)") from None  # fmt: skip
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
