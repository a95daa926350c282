"""One SGLang engine in its own process, driven over a local authenticated socket.

The engine cannot live in the trainer's process: `Engine.shutdown()` kills every descendant of
the process that made it, and `SGLANG_USE_CPU_ENGINE` must be set before sglang is imported.
`python -m onpolicy.rollout.host` starts the engine (`onpolicy.rollout.engine.launch`), listens
on 127.0.0.1 with an authkey (`multiprocessing.connection`'s handshake), writes its address file
last, and serves one client's session at a time: generate, the weight-update session and its
transports, the weight report. No client can hold the host: a connection must authenticate
within STALL_S, a request once begun must arrive within it and a reply be taken within REPLY_S,
or the client is dropped; a waiting client's `shutdown` is served at once. `EngineClient` is
the other end; a request can be sent and its reply collected later, which is how a trainer
broadcasts while the engine receives. `EngineService` (the engine in this process) and
`EngineClient` are both an `onpolicy.rollout.engine.EngineHandle`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
    wait,
)
from pathlib import Path
from typing import Any

from onpolicy.rollout import engine as E
from onpolicy.rollout.engine import EngineOp, RemoteOps, RolloutRequest

KEY_ENV = "ONPOLICY_HOST_KEY"
"""The authkey (hex) the host and its clients share; only the host's starter knows it."""

STALL_S = 10.0
"""Seconds a connection may stall mid-exchange (authenticating, or a request once begun) before
the host drops it: a client that connects and says nothing never holds the host."""

REPLY_S = 900.0
"""Seconds a reply may wait to be taken (the host's send), and a client's request to be taken
(the client's send), before that side gives up on the other."""


class EngineError(RuntimeError):
    """An engine refused a request, or its process died."""


# --- the engine's operations ---------------------------------------------------------------
class EngineService:
    """An `sglang.Engine` started in this process and the operations a trainer or driver asks
    of it, by name (an `EngineHandle`). The socket host below serves them; a Ray actor can hold
    one as well. `send` runs an op at once and keeps its value (or error) for `result`."""

    def __init__(self, ckpt: str, *, tp: int = 1, ep: int = 1, dtype: str = "bfloat16",
                 exact: bool = True, name: str = "engine", **engine_extra) -> None:  # fmt: skip
        self.name, self.tp, self.ep = name, tp, ep
        self.engine = E.launch(str(ckpt), tp, ep, dtype, exact=exact, **engine_extra)
        self._done: list[tuple[str, bool, Any]] = []

    # --- the transport (in this process: an op runs when it is sent)
    def send(self, op: EngineOp, **kw) -> None:
        try:
            self._done.append((op, True, getattr(self, op)(**kw)))
        except Exception as e:  # kept for result(), as a remote engine's reply would be
            self._done.append((op, False, e))

    def result(self, timeout: float = 900.0):
        _op, ok, value = self._done.pop(0)
        if not ok:
            raise value
        return value

    def call(self, op: EngineOp, timeout: float = 900.0, **kw):
        self.send(op, **kw)
        return self.result(timeout)

    # --- the ops
    def info(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "pid": os.getpid(),
                "weight_version": self.engine.get_model_info()["weight_version"]}  # fmt: skip

    def generate(self, request: dict | RolloutRequest, **options) -> list[dict]:
        """`onpolicy.rollout.engine.sample` of the request; `options`: sample's keywords."""
        req = request if isinstance(request, RolloutRequest) else RolloutRequest(**request)
        return E.sample(self.engine, req, **options)

    def begin_weight_update(self):
        return self.engine.begin_weight_update()

    def end_weight_update(self):
        return self.engine.end_weight_update()

    def init_weights_update_group(self, **kw):
        return self.engine.init_weights_update_group(**kw)

    def destroy_weights_update_group(self, group_name: str):
        return self.engine.destroy_weights_update_group(group_name)

    def update_weights_from_distributed(self, **kw):
        return E.update_weights_from_distributed(self.engine, **kw)

    def update_weights_from_tensor(self, **kw):
        return E.update_weights_from_tensor(self.engine, **kw)

    def report_weights(self) -> list[list[dict]]:
        """Every TP rank's `onpolicy.rollout.weights.report`, in rank order."""
        with tempfile.TemporaryDirectory(prefix="onpolicy-report-") as d:
            self.engine.collective_rpc("onpolicy_report_weights", path=d)
            return [json.loads((Path(d) / f"rank{r}.json").read_text())
                    for r in range(self.tp)]  # fmt: skip

    def capture_generate(self, request: dict, out_dir: str) -> dict:
        """`generate` of one prompt with every TP rank's per-layer points captured into
        `out_dir` (`onpolicy.rollout.capture`, for `onpolicy.grpo.bisect`); the sample."""
        from onpolicy.rollout.capture import capture_generate

        return capture_generate(self.engine, request, out_dir)

    def release_memory(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while a colocated trainer
        trains; `resume_memory` takes it back before the weight sync."""
        self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        self.engine.resume_memory_occupation()

    def memory_usage(self) -> dict:
        """SGLang's account of the engine's GPU memory, in GB (2**30 bytes) to 3 decimals:
        `weight` (measured around the load), `kvcache` (the pool's buffers), `graph`."""
        return self.engine.get_server_info()["internal_states"][0]["memory_usage"]

    def shutdown(self) -> None:
        self.engine.shutdown()


class _Host(EngineService):
    """The socket server around an `EngineService`."""

    def serve(self, server: socket.socket, key: bytes) -> None:
        """Serve requests until a client asks for `shutdown`. One session at a time: the active
        client's requests run in order; clients that connect meanwhile wait, in order, with at
        most one request read and held each, except `shutdown`, which is served at once."""
        active: Connection | None = None
        waiting: list[list] = []  # [conn, its held request or None]
        try:
            while True:
                watch = [server, *([active] if active else []),
                         *(c for c, held in waiting if held is None)]  # fmt: skip
                for ready in wait(watch):
                    if ready is server:
                        if (conn := _accept(server, key)) is not None:
                            waiting.append([conn, None])
                        continue
                    request = _read(ready)
                    if ready is active:
                        if request is None or not self._answer(active, request):
                            active = _close(active)
                        elif request[0] == "shutdown":
                            return
                        continue
                    entry = next(e for e in waiting if e[0] is ready)
                    if request is None:
                        waiting.remove(entry)
                        _close(ready)
                    elif request[0] == "shutdown":
                        self._answer(ready, request)
                        return
                    else:
                        entry[1] = request
                while active is None and waiting:  # the next session, its held request first
                    active, held = waiting.pop(0)
                    if held is not None and not self._answer(active, held):
                        active = _close(active)
        finally:
            for conn in [active, *(c for c, _ in waiting)]:
                _close(conn)

    def _answer(self, conn: Connection, request: tuple) -> bool:
        """Run one request and send its reply; False when the client did not take it."""
        op, kw = request
        if op == "shutdown":
            reply = ("ok", None)
        else:
            try:
                reply = ("ok", getattr(self, op)(**kw))
            except Exception as e:  # the reply names it; the engine keeps serving
                reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except OSError as e:
            _say(f"dropped a client that did not take the reply to {op} within {REPLY_S:.0f} s "
                 f"({type(e).__name__})")  # fmt: skip
            return False
        return True


def _bound(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Each blocking read (write) on `sock` fails with OSError after `recv_s` (`send_s`) seconds
    without progress; 0 lifts the bound."""
    for opt, sec in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(sec), int(sec % 1 * 1e6)))


def _accept(server: socket.socket, key: bytes) -> Connection | None:
    """The next connection, authenticated within STALL_S; None (and a line on stderr) if not."""
    sock, peer = server.accept()
    _bound(sock, STALL_S, REPLY_S)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    except (OSError, EOFError, AuthenticationError) as e:
        _say(f"dropped a connection from {peer[0]}:{peer[1]} that did not authenticate within "
             f"{STALL_S:.0f} s ({type(e).__name__})")  # fmt: skip
        conn.close()
        return None
    return conn


def _read(conn: Connection) -> tuple | None:
    """The request a readable client sent; None if it closed, or stalled past STALL_S."""
    try:
        return conn.recv()
    except EOFError:
        return None
    except OSError as e:
        _say(f"dropped a client whose request did not arrive within {STALL_S:.0f} s "
             f"({type(e).__name__})")  # fmt: skip
        return None


def _close(conn: Connection | None) -> None:
    if conn is not None:
        conn.close()


def _say(msg: str) -> None:
    print(f"engine host: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.rollout.host", description=__doc__)
    ap.add_argument("--ckpt", required=True, help="HF checkpoint the engine starts from")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stock", action="store_true", help="SGLang's stock CPU path")
    ap.add_argument("--address-file", required=True, help="written once the engine serves")
    ap.add_argument("--engine-args", default="{}", help="JSON of further exact_engine_args "
                    "keywords (e.g. return_routed_experts)")  # fmt: skip
    args = ap.parse_args(argv)
    key = bytes.fromhex(os.environ.pop(KEY_ENV))
    # The engine's processes inherit this authkey, so they may fetch shared-memory tensor
    # handles from a client holding the same key (the colocated tensor transport).
    multiprocessing.current_process().authkey = key
    host = _Host(args.ckpt, tp=args.tp, ep=args.ep, dtype=args.dtype, exact=not args.stock,
                 **json.loads(args.engine_args))  # fmt: skip
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            out = Path(args.address_file)
            tmp = out.with_name(out.name + ".tmp")
            addr = {"host": "127.0.0.1", "port": server.getsockname()[1], "pid": os.getpid(),
                    "tp": args.tp, "ep": args.ep}  # fmt: skip
            tmp.write_text(json.dumps(addr))
            os.replace(tmp, out)
            host.serve(server, key)
    finally:
        host.shutdown()


# --- starting a host ------------------------------------------------------------------------
@dataclass
class EngineHost:
    """A started host process; clients `connect()` to it, one at a time."""

    name: str
    """A label for messages (e.g. "engine1")."""
    proc: subprocess.Popen
    """The host process."""
    address_file: Path
    """Where it wrote its address."""
    key: str
    """The authkey (hex)."""
    log: Path
    """Its stdout and stderr."""

    @classmethod
    def start(cls, name: str, ckpt: str | os.PathLike, workdir: str | os.PathLike, *, tp: int = 1,
              ep: int = 1, dtype: str = "bfloat16", exact: bool = True,
              key: str | None = None, engine_args: dict | None = None,
              cache: str | os.PathLike | None = None) -> EngineHost:  # fmt: skip
        """Start a host for an engine on `ckpt`; `wait()` for it to serve. `key`: the authkey
        (hex) to share with this host's clients; a fresh one by default. `engine_args`: further
        `exact_engine_args` keywords (JSON-safe), e.g. {"return_routed_experts": True}.
        `cache`: the folder of the compile caches (`engine_env`); `workdir`/cache by default."""
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        addr, log = work / f"{name}.address.json", work / f"{name}.log"
        addr.unlink(missing_ok=True)
        key = key or secrets.token_hex(16)
        env = E.engine_env(tp, cache or work / "cache", base=clean_env())
        env[KEY_ENV] = key
        cmd = [sys.executable, "-m", "onpolicy.rollout.host", "--ckpt", str(ckpt), "--tp", str(tp),
               "--ep", str(ep), "--dtype", dtype, "--address-file", str(addr),
               "--engine-args", json.dumps(engine_args or {})]  # fmt: skip
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd + ([] if exact else ["--stock"]), env=env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        return cls(name=name, proc=proc, address_file=addr, key=key, log=log)

    def wait(self, timeout: float = 900.0) -> EngineHost:
        """Block until the engine serves; EngineError naming the log if it died first."""
        deadline = time.monotonic() + timeout
        while not self.address_file.exists():
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name}: the engine host exited with "
                                  f"{self.proc.returncode} while starting; see {self.log}:\n"
                                  f"{_tail(self.log)}")  # fmt: skip
            if time.monotonic() > deadline:
                self._kill()
                raise EngineError(f"{self.name}: the engine did not start within {timeout:.0f} s; "
                                  f"see {self.log}")  # fmt: skip
            time.sleep(0.5)
        return self

    def connect(self) -> EngineClient:
        client = EngineClient.connect(self.name, self.wait().address_file, self.key)
        client.proc, client.log = self.proc, self.log
        return client

    def stop(self, timeout: float = 120.0) -> None:
        """Shut the engine down (it frees its scheduler processes): connect, ask, and wait for
        the host to exit, all within `timeout` s, whoever else is connected; past it, or if
        the engine is not serving yet, kill the host's process group, saying why on stderr."""
        if self.proc.poll() is not None:
            return
        if not self.address_file.exists():
            _say(f"{self.name}: not serving yet; killing its process group")
            self._kill()
            return
        deadline = time.monotonic() + timeout
        step = "the connection"
        try:
            c = EngineClient.connect(self.name, self.address_file, self.key,
                                     timeout=max(0.1, deadline - time.monotonic()))  # fmt: skip
            c.proc, c.log = self.proc, self.log
            step = "the reply to shutdown"
            c.call("shutdown", timeout=max(0.1, deadline - time.monotonic()))
            c.close()
            step = "the host's exit"
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except (EngineError, OSError, ValueError, subprocess.TimeoutExpired) as e:
            _say(f"{self.name}: no clean shutdown within {timeout:.0f} s (waiting for {step}: "
                 f"{type(e).__name__}: {e}); killing its process group")  # fmt: skip
            self._kill()

    def _kill(self) -> None:
        """SIGKILL the host and everything in its process group, and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# --- the client -----------------------------------------------------------------------------
@dataclass
class EngineClient(RemoteOps):
    """A connection to one engine host (an `EngineHandle`: every named op is a `call`)."""

    name: str
    """A label for messages (e.g. "engine 1")."""
    tp: int
    """The engine's TP size (its ranks in a weight-update group)."""
    ep: int
    """The engine's EP size."""
    conn: Connection
    """The authenticated socket."""
    proc: subprocess.Popen | None = None
    """The host process, when this process started it (its death is then seen at once)."""
    log: Path | None = None
    """The host's log, named in errors."""
    pending: list[str] = field(default_factory=list)
    """Ops sent whose replies are not collected yet, oldest first."""

    @classmethod
    def connect(cls, name: str, address_file: str | os.PathLike, key: str,
                timeout: float = 120.0) -> EngineClient:  # fmt: skip
        """Connect to a running host by its address file; EngineError if the host does not
        take and authenticate the connection within `timeout` s (it answers between requests,
        so a long request of another client delays it)."""
        a = json.loads(Path(address_file).read_text())
        # The same authkey as the engine's processes: they then accept this process's
        # shared-memory tensor handles (torch's file-descriptor sharing authenticates with it).
        multiprocessing.current_process().authkey = secret = bytes.fromhex(key)
        where = f"{a['host']}:{a['port']}"
        try:
            sock = socket.create_connection((a["host"], a["port"]), timeout=timeout)
        except OSError as e:
            raise EngineError(f"{name}: cannot connect to the engine host at {where}: {e}") from e
        sock.settimeout(None)
        _bound(sock, timeout, timeout)
        conn = Connection(sock.detach())
        try:
            answer_challenge(conn, secret)
            deliver_challenge(conn, secret)
        except (OSError, EOFError) as e:
            conn.close()
            msg = f"did not authenticate this client within {timeout:.0f} s ({type(e).__name__})"
            raise EngineError(f"{name}: the engine host at {where} {msg}") from e
        with socket.socket(fileno=os.dup(conn.fileno())) as s:  # the same socket: its options
            _bound(s, 0, REPLY_S)  # replies: `result` bounds them; requests: REPLY_S
        return cls(name=name, tp=a["tp"], ep=a["ep"], conn=conn)

    def send(self, op: str, **kw) -> None:
        """Send a request; collect its reply with `result()`."""
        try:
            self.conn.send((op, kw))
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            raise self._died(op) from e
        except OSError as e:  # SO_SNDTIMEO: the host took none of it
            raise EngineError(f"{self.name}: the engine host did not take the request {op} "
                              f"within {REPLY_S:.0f} s") from e  # fmt: skip
        self.pending.append(op)

    def result(self, timeout: float = 900.0):
        """The oldest pending request's value; EngineError if it failed or the engine died."""
        op = self.pending.pop(0)
        deadline = time.monotonic() + timeout
        try:
            while not self.conn.poll(1.0):
                if self.proc is not None and self.proc.poll() is not None:
                    raise self._died(op)
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name}: no reply to {op} within {timeout:.0f} s")
            status, value = self.conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError) as e:
            raise self._died(op) from e
        if status != "ok":
            raise EngineError(f"{self.name}: {op} failed: {value}")
        return value

    def call(self, op: str, timeout: float = 900.0, **kw):
        """Send a request and wait for its value."""
        self.send(op, **kw)
        return self.result(timeout)

    def _died(self, op: str) -> EngineError:
        where = f"; see {self.log}:\n{_tail(self.log)}" if self.log else ""
        return EngineError(f"{self.name}: the engine process died during {op}{where}")

    def shutdown(self) -> None:
        """Shut the engine down (the host then exits) and disconnect."""
        self.call("shutdown")
        self.close()

    def close(self) -> None:
        """Disconnect; the host serves the next client."""
        self.conn.close()


def clean_env() -> dict[str, str]:
    """This environment without torchrun's rendezvous variables, which an engine must not see."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE"}  # fmt: skip
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith("TORCHELASTIC_")}  # fmt: skip


def _tail(log: Path | None, n: int = 20) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


if __name__ == "__main__":
    main()
