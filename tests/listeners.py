"""Which TCP sockets a job's processes listen on, and the check that none is beyond loopback.

`Listeners` watches its root pids and every process under them (through
/proc/PID/task/TID/children) and, given a run id, every process carrying it (a process that left
the tree, `onpolicy.grpo.procs.run_processes`). While it is open a thread samples their
listening sockets every `every` seconds; `stop()` samples once more, so what still listens when
a job ends is counted too. `wild()` is what listened on an address that is not loopback (0.0.0.0
and :: among them); `check(what)` raises naming each one, its port and its process.

A sample reads /proc/net/tcp and tcp6 once and the fd links of the watched processes: with no
process watched it reads nothing, so a session can keep one open throughout.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"
"""A socket's state in /proc/net/tcp when it listens."""


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    pid: int
    name: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip.removeprefix("::ffff:")).is_loopback

    def __str__(self) -> str:
        return f"{self.ip}:{self.port} (pid {self.pid} {self.name})"


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (not `pid` itself)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN:
                out[int(f[9])] = _address(f[1])
    return out


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _name(pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


class Listeners:
    """The listening sockets seen of `roots`, every process under them and every process
    carrying `run_id`, sampled every `every` seconds while open (`with`, or `start()` and
    `stop()`)."""

    def __init__(self, *roots: int, run_id: str | None = None, every: float = 0.2) -> None:
        self.roots, self.run_id, self.every = roots, run_id, every
        self.seen: set[Listener] = set()
        self.reported: set[Listener] = set()
        """Wild ones a caller has dealt with already (the session's check, test by test)."""
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pids(self) -> set[int]:
        out = set(self.roots)
        for r in self.roots:
            out |= descendants(r)
        if self.run_id:
            from onpolicy.grpo.procs import run_processes

            out |= set(run_processes(self.run_id))
        return out

    def sample(self) -> None:
        """Record what the watched processes listen on now."""
        pids = self.pids()
        listening = listening_sockets() if pids else {}
        found = set()
        for pid in pids if listening else ():
            for inode in _sockets_of(pid) & listening.keys():
                found.add((*listening[inode], pid))
        with self._lock:
            known = {(x.ip, x.port, x.pid) for x in self.seen}
            self.seen |= {Listener(ip, port, pid, _name(pid)) for ip, port, pid in found - known}
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def start(self) -> Listeners:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="listeners", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Listeners:
        """Stop sampling, then sample once more (what still listens at the end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self

    def __enter__(self) -> Listeners:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wild(self) -> set[Listener]:
        """What listened beyond loopback."""
        with self._lock:
            return {x for x in self.seen if not x.loopback}

    def names(self) -> set[str]:
        with self._lock:
            return {x.name for x in self.seen}

    def check(self, what: str) -> None:
        """AssertionError naming every listener beyond loopback seen of `what`."""
        if wild := self.wild():
            listed = ", ".join(map(str, sorted(wild, key=lambda x: (x.pid, x.port))))
            raise AssertionError(f"{what}: listening beyond loopback: {listed}")
