"""Which TCP sockets a job's processes listen on, and the check that none is beyond loopback.

`Listeners` watches its root pids and every process under them (their parent pids in
/proc/PID/stat) and, given a run id, every process carrying it (a process that left the tree,
`onpolicy.grpo.procs.run_processes`' rule). While it is open a thread samples their
listening sockets every `every` seconds; `stop()` samples once more, so what still listens when
a job ends is counted too. `wild()` is what listened on an address that is not loopback (0.0.0.0
and :: among them); `check(what)` raises naming each one, its port and its process.

A sample reads /proc/PID/stat of every process once, the host's listening sockets (one netlink
dump) and, when the watched processes or the listening sockets changed since the last sample,
the fd links of the watched processes: cheap enough for a session to keep one open throughout,
beside a job's own.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
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


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process, from one pass over /proc/PID/stat."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split(None, 2)
        except (OSError, IndexError):
            continue
        out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def descendants(pid: int, procs: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """Every live process under `pid` (not `pid` itself); `procs` is a `processes()` pass."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _state) in (processes() if procs is None else procs).items():
        children.setdefault(ppid, []).append(p)
    out, todo = set(), [pid]
    while todo:
        for k in children.get(todo.pop(), ()):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def carrying(needle: bytes, procs: dict[int, tuple[int, str]], skip: set[int]) -> set[int]:
    """The processes of `procs` (but `skip`, and zombies) whose environment holds `needle`
    (`onpolicy.grpo.procs.run_processes`' rule, on a pass already made)."""
    out = set()
    for p, (_ppid, state) in procs.items():
        if p in skip or state == "Z":
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.add(p)
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace:
    the kernel's socket-diagnostics netlink dump of the listening state only (a /proc/net/tcp
    read walks the whole connection table, milliseconds on a large host), or /proc/net/tcp and
    tcp6 where that netlink family is not available."""
    try:
        return _listening_from_netlink()
    except OSError:
        return _listening_from_proc()


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 2, 3
TCP_LISTEN = 10


def _listening_from_netlink() -> dict[int, tuple[str, int]]:
    """`inet_diag_req_v2` dumps of TCP over IPv4 and IPv6 with only the listening state asked
    for; each reply's `inet_diag_msg` gives the family, the local port and address and the
    inode."""
    out = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
            req += bytes(48)  # inet_diag_sockid: no filter
            head = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY,
                               NLM_F_REQUEST | NLM_F_DUMP, seq, 0)  # fmt: skip
            s.send(head + req)
            done = False
            while not done:
                buf = s.recv(1 << 16)
                if not buf:
                    raise OSError("sock_diag: the dump ended without NLMSG_DONE")
                off = 0
                while off + 16 <= len(buf) and not done:
                    length, kind = struct.unpack_from("=IH", buf, off)
                    if kind == NLMSG_DONE:
                        done = True
                    elif kind == NLMSG_ERROR:
                        raise OSError(f"sock_diag: error {struct.unpack_from('=i', buf, off + 16)}")
                    else:
                        m = off + 16  # inet_diag_msg
                        fam = buf[m]
                        port = struct.unpack_from(">H", buf, m + 4)[0]
                        addr = buf[m + 8 : m + (12 if fam == socket.AF_INET else 24)]
                        inode = struct.unpack_from("=I", buf, m + 68)[0]
                        out[inode] = (socket.inet_ntop(fam, addr), port)
                    off += (length + 3) & ~3
    return out


def _listening_from_proc() -> dict[int, tuple[str, int]]:
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
        self._last: tuple[frozenset, frozenset] | None = None
        """The watched pids and the listening inodes at the last sample."""

    def pids(self) -> set[int]:
        procs = processes()
        out = set(self.roots)
        for r in self.roots:
            out |= descendants(r, procs)
        if self.run_id:
            from onpolicy.grpo.procs import RUN_ID_ENV

            mine = set()  # this process and those above it (as run_processes spares them)
            p = os.getpid()
            while p > 1 and p not in mine:
                mine.add(p)
                p = procs.get(p, (0, ""))[0]
            needle = f"{RUN_ID_ENV}={self.run_id}".encode()
            out |= carrying(needle, procs, skip=out | mine)
        return out

    def sample(self) -> None:
        """Record what the watched processes listen on now. The processes' open sockets are
        read only when the watched processes or the host's listening sockets changed since the
        last sample (otherwise they hold what that sample found, all of it recorded)."""
        pids = self.pids()
        listening = listening_sockets() if pids else {}
        state = (frozenset(pids), frozenset(listening))
        found = set()
        if state != self._last:
            for pid in pids if listening else ():
                for inode in _sockets_of(pid) & listening.keys():
                    found.add((*listening[inode], pid))
        with self._lock:
            known = {(x.ip, x.port, x.pid) for x in self.seen}
            self.seen |= {Listener(ip, port, pid, _name(pid)) for ip, port, pid in found - known}
            self.samples += 1
            self._last = state

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
