"""A torch.distributed TCPStore whose server listens on the address it is given, and nowhere else.

torch's TCPStore server binds every interface (`::`), whatever host it is given; the run's
rendezvous (the trainer's process group, the weight-sync group) must listen on the run's bind
address only (127.0.0.1 by default). The master binds its own socket there and hands the store
the listening file descriptor (`master_listen_fd`). `free_port` is the one free-port helper,
`torchrun` the one command line of a local torchrun job, `loopback_env` what its ranks need to
keep gloo's pairs on the loopback interface, `run_group` the one way to run such a job (or any
worker) with a bounded wait.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick; a later bind may still race for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, host: str = "127.0.0.1") -> list[str]:
    """The command line of a local torchrun job of `nproc` ranks running `args` (a script or
    `-m module`, then its arguments), its rendezvous on `host` at a free port."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-addr={host}", f"--master-port={free_port(host)}", *args]  # fmt: skip


def loopback_env(host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for ranks whose rendezvous is on `host`: gloo binds its pairs to the address
    the machine's host name resolves to unless told the interface, so on a loopback host it is
    told `lo`."""
    return {"GLOO_SOCKET_IFNAME": "lo"} if host in ("127.0.0.1", "localhost", "::1") else {}


def run_group(cmd: list[str], *, env: dict[str, str], timeout: float,
              **popen: object) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run` in a process group of its own: past `timeout` the whole group (torchrun
    and every rank, a worker and what it started) is killed, then TimeoutExpired is raised
    with what it printed. `popen`: stdout, stderr, text, as Popen takes them."""
    with subprocess.Popen(cmd, env=env, start_new_session=True, **popen) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


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
