"""Local multi-rank jobs and torch.distributed stores that listen on the address given, and
nowhere else.

torch's TCPStore server binds every interface (`::`), whatever host it is given: torchrun's
rendezvous store, and the store `init_process_group("env://")` starts in rank 0, both do. The
run's rendezvous (the trainer's process group, the weight-sync group) and every job the project
launches must listen on the run's bind address only (127.0.0.1 by default). `tcp_store` binds
its own socket there and hands the store the listening file descriptor (`master_listen_fd`).
`torchrun` is the one command line of a local job of N ranks: this module's launcher
(`python -m onpolicy.rendezvous`, not torch.distributed.run) holds the job's store on such a
socket and starts the ranks with torchrun's environment, so the ranks' `env://` rendezvous
joins it as clients (TORCHELASTIC_USE_AGENT_STORE) and opens no store of its own.
`loopback_env` is what keeps gloo's pairs on the loopback interface, `run_group` the one way
to run such a job (or any worker) with a bounded wait, `free_port` the one free-port helper.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

STOP_GRACE_S = 30.0
"""Seconds the launcher gives the other ranks to exit after SIGTERM, once one rank failed."""

DUMP_S = 5.0
"""Seconds `run_group` gives a timed-out group to print its stacks (SIGABRT) before SIGKILL."""
KILLED_S = 10.0
"""How long `run_group` waits, after SIGKILL, for every process of the group to be gone: a
process has closed its pipes before it has finished exiting."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick; a later bind may still race for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, host: str = "127.0.0.1") -> list[str]:
    """The command line of a local job of `nproc` ranks running `args` (a script or `-m module`,
    then its arguments) as torchrun would (`python -u ARGS`, torchrun's environment), its store
    and gloo's pairs listening on `host` only. Run it with `run_group`."""
    return [sys.executable, "-m", "onpolicy.rendezvous", f"--nproc={nproc}", f"--host={host}",
            "--", *args]  # fmt: skip


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The bind addresses that mean this host's loopback interface only."""


def loopback_env(host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for ranks whose rendezvous is on `host`: gloo binds its pairs to the address
    the machine's host name resolves to, and NCCL's bootstrap to the interface it picks, unless
    told the interface, so on a loopback host both are told `lo`."""
    if host not in LOOPBACK_HOSTS:
        return {}
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def rank_env(rank: int, nproc: int, host: str, port: int) -> dict[str, str]:
    """What torchrun sets for local rank `rank` of a one-node job, plus `loopback_env`; the
    ranks' env:// rendezvous joins the launcher's store at host:port as a client."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
           "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1,
           "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default", "MASTER_ADDR": host,
           "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": True,
           "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}  # fmt: skip
    return {**{k: str(v) for k, v in env.items()}, **loopback_env(host)}


def launch(nproc: int, args: list[str], host: str = "127.0.0.1") -> int:
    """Hold the job's store on `host`, run `nproc` ranks of `python -u ARGS`, and return 0 once
    all exit 0; when one fails, SIGTERM the others (SIGKILL after STOP_GRACE_S) and return its
    exit status (128 + the signal if a signal ended it). The ranks share this process's group,
    so `run_group`'s kill reaches them; SIGTERM or SIGINT here kills them too."""
    store = tcp_store(host, 0, nproc, is_master=True)
    base = dict(os.environ)
    if nproc > 1:  # torchrun's default: one thread each unless told otherwise
        base.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            env = {**base, **rank_env(r, nproc, host, store.port)}
            procs.append(subprocess.Popen([sys.executable, "-u", *args], env=env))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, code = failed[0]
                print(f"onpolicy.rendezvous: rank {r} of {nproc} exited {code}; stopping the "
                      "others", file=sys.stderr, flush=True)  # fmt: skip
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _stop(procs: list[subprocess.Popen]) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_group(cmd: list[str], *, env: dict[str, str], timeout: float,
              **popen: object) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` in a process group of its own: past `timeout` the whole group (the
    launcher and every rank, a worker and what it started) is killed, then TimeoutExpired is
    raised with what it printed. Where `env` sets PYTHONFAULTHANDLER (the test harness does),
    the group gets SIGABRT first, so each Python process of it prints every thread's stack (no
    core file: the group's core limit is 0), and SIGKILL DUMP_S later. `popen`: stdout,
    stderr, text, as Popen takes them."""
    dump = bool(env.get("PYTHONFAULTHANDLER"))
    with subprocess.Popen(cmd, env=env, start_new_session=True, **popen) as p:
        if dump:  # before the leader forks anything: its children inherit the limit
            with contextlib.suppress(OSError):
                resource.prlimit(p.pid, resource.RLIMIT_CORE, (0, 0))
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            got = None
            if dump:  # read on while they print: a full pipe would block a dump
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    got = p.communicate(timeout=DUMP_S)
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            out, err = got or p.communicate()
            deadline = time.monotonic() + KILLED_S
            while group_members(p.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def proc_stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, ...), or None if the
    process is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that have not finished exiting (zombies are done),
    from /proc."""
    found = []
    for d in Path("/proc").iterdir():
        fields = proc_stat(d.name) if d.name.isdigit() else None
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(d.name))
    return found


def tcp_store(host: str, port: int, world: int, *, is_master: bool,
              timeout: timedelta = timedelta(seconds=900)) -> dist.TCPStore:  # fmt: skip
    """The store at host:port (port 0 on the master: any free one; read it from `.port`)."""
    if not is_master:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(max(world, 128))
    bound = sock.getsockname()[1]
    # detach: the store owns the descriptor from here on (closing it with the store).
    return dist.TCPStore(host, bound, world, is_master=True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.rendezvous", description=launch.__doc__)
    ap.add_argument("--nproc", type=int, required=True, help="ranks to start")
    ap.add_argument("--host", default="127.0.0.1", help="the one address the job listens on")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then a script or -m module, "
                    "then its arguments")  # fmt: skip
    a = ap.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        ap.error("nothing to run: give a script or -m module after --")
    return launch(a.nproc, args, a.host)


if __name__ == "__main__":
    sys.exit(main())
