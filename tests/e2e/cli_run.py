"""One `onpolicy e2e` process as the e2e tests run it, and what they check of its output.

Each run is the CLI in its own process, with a run id in its environment that every process of
the run inherits; while it runs, `listeners.Listeners` records every listening socket of those
processes (every 0.2 s, and once more when it has exited), and `check_clean` checks that none
of them is left.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from listeners import Listeners
from onpolicy.grpo.procs import run_processes

REPO = Path(__file__).resolve().parents[2]
ABS_DIFF, KL = "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"
WANDB = "offline" if importlib.util.find_spec("wandb") else "disabled"
"""The runs' wandb mode: offline where wandb is installed (the CPU suite), so its sink runs."""


def sets(*kvs: str) -> list[str]:
    """Command-line overrides: `--set KEY=VALUE` for each of `kvs`."""
    return [x for kv in kvs for x in ("--set", kv)]


def _default_sigint() -> None:
    """The run takes Ctrl-C as a terminal would deliver it, even where pytest itself was started
    in the background of a script, which hands its children SIGINT ignored (and Python then
    installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


LIVE: set[Run] = set()
"""Runs started and not yet waited for (`stop_all` ends them when a test fails or times out)."""


def stop_all() -> None:
    """Kill every run still live and every process of it: a test that failed or ran out of
    time (pytest-timeout) leaves none running beside the next."""
    for run in list(LIVE):
        run.stop()


@contextlib.contextmanager
def stopped_on_error():
    """A block (a fixture's runs) whose live runs are stopped if it raises or times out."""
    try:
        yield
    except BaseException:
        stop_all()
        raise


class Run:
    """One `onpolicy e2e --config <config>` process and what was seen of it. `cache` is the
    session's compile cache (run.cache_dir); `path`, folders the run imports from (a custom
    reward's module)."""

    def __init__(self, config: Path, out: Path, *args: str, steps: int, log: str = "",
                 cache: Path | None = None, path: tuple[Path, ...] = ()) -> None:  # fmt: skip
        self.out, self.run_id = out, uuid.uuid4().hex
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / "integration"), *map(str, path), os.environ.get("PYTHONPATH", "")]
            ),
        }
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the driver's own, not conftest's
        cmd = [sys.executable, "-m", "onpolicy.cli", "e2e", "--config", str(config), "--out",
               str(out), "--run-id", self.run_id, "--steps", str(steps),
               "--set", "run.progress=false", "--set", f"run.wandb_mode={WANDB}",
               *args]  # fmt: skip
        if cache is not None:
            cmd += ["--set", f"run.cache_dir={json.dumps(str(cache))}"]
        self.log = out.parent / f"{log or out.name}.log"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log.open("w")
        self.t0 = time.perf_counter()
        self.wall_s = 0.0
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=REPO, preexec_fn=_default_sigint)  # fmt: skip
        # The driver's tree, and what carries the run id (a process that left the tree).
        self.watch = Listeners(self.proc.pid, run_id=self.run_id).start()
        LIVE.add(self)

    @property
    def listeners(self) -> set[tuple[str, int, str]]:
        """(address, port, process name) of every listening socket seen of the run."""
        return {(x.ip, x.port, x.name) for x in self.watch.seen}

    def until(self, ready, timeout: float = 900) -> bool:
        """Poll `ready()` while the run lives; True once it holds, False if the run ended (or
        `timeout` passed) first."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.2)
        return False

    def wait(self, timeout: float = 900) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.stop()
            self._done()
        return self.proc.returncode

    def stop(self) -> None:
        """Kill the driver and every process of the run."""
        self.proc.kill()
        self.proc.wait()
        for pid in run_processes(self.run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._done()

    def _done(self) -> None:
        if self in LIVE:
            LIVE.discard(self)
            self.wall_s = time.perf_counter() - self.t0
            self.watch.stop()
            self._log.close()

    @property
    def code(self) -> int | None:
        return self.proc.returncode

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> list[dict]:
        from onpolicy.grpo.metrics import read_metrics

        return read_metrics(self.out / "metrics.jsonl")

    def samples(self, name: str) -> list[dict]:
        lines = (self.out / "samples" / f"{name}.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines]

    def latest(self) -> int | None:
        """The step `checkpoints/latest` names, None before the first save."""
        try:
            return int((self.out / "checkpoints" / "latest").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def check_clean(self) -> None:
        """No process of the run is left (the driver reaps; this checks it did)."""
        left = run_processes(self.run_id)
        assert not left, f"processes of the run left after exit: {left}\n{self.text[-3000:]}"


MEASURED = ("time/", "perf/", "memory/", "compile/")
"""Metrics measured from the machine (wall times, tokens per second, memory peaks, the Triton
kernels a step compiled or loaded, which follow the cache and the warm-up): they differ between
two runs of the same steps."""


def steady(row: dict) -> dict:
    """A step's metrics without the measured ones (MEASURED)."""
    return {k: v for k, v in row.items() if not k.startswith(MEASURED)}


def weights(out: Path, iteration: int) -> dict[str, torch.Tensor]:
    from onpolicy.checkpoint import torch_dist

    return torch_dist.global_tensors(out / "checkpoints" / f"iter_{iteration:07d}")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    from onpolicy.bits import as_bits

    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(as_bits(a[k]), as_bits(b[k]))]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def assert_on_policy(rows: list[dict], steps: int, text: str = "") -> None:
    """Every step of `rows` (1..steps) trained on exactly the rollout's log-probs and routes."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), text[-3000:]
    for r in rows:
        assert r[ABS_DIFF] == 0.0 and r[KL] == 0.0, r
        assert r["train/logprob_equal_frac"] == 1.0 and r["train/tokens_compared"] > 0, r
        assert r["train/routing_mismatch"] == 0.0 and r["train/routing_rows"] > 0, r
