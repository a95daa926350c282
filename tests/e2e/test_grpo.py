"""`onpolicy e2e` on configs/tiny-cpu.toml: real Ray, 8 Megatron ranks (TP2 PP2 EP2 SP), two
exact SGLang engines (TP2 EP2), every step asserting train == rollout bit for bit.

Each run is the CLI in its own process, with a run id in its environment that every process of
the run inherits; while it runs, the test records every listening socket of those processes,
and after it exits, checks that none of them is left. The runs:
- `base`: 2 steps, a checkpoint after each; every step's abs_diff and kl are 0.0 in the JSONL;
- `replay`: the same config again: the same metrics and the same weights;
- `killed`: trainer rank 3 is killed in step 2: the run stops naming it; `--resume` then
  continues from the step-1 checkpoint to the uninterrupted run's metrics and weights;
- `stock`: the rollout on SGLang's stock path (the assertion's negative control): the run
  stops at step 1 naming the first differing token;
- `interrupted`: SIGINT after step 1: torn down, exit 130;
- `learning`: colocated engines on 4 trainer ranks with the tensor transport, 15 steps: the
  reward rises.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.toml"
ABS_DIFF, KL = "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"

pytestmark = pytest.mark.slow


# --- running the CLI --------------------------------------------------------------------------
def run_processes(run_id: str) -> list[int]:
    from onpolicy.grpo.procs import run_processes as found

    return found(run_id)


def _default_sigint() -> None:
    """The run takes Ctrl-C as a terminal would deliver it, even where pytest itself was started
    in the background of a script, which hands its children SIGINT ignored (and Python then
    installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """One `onpolicy e2e` process and what was seen of it."""

    def __init__(self, out: Path, *args: str, steps: int = 2, log: str = "") -> None:
        self.out, self.run_id = out, uuid.uuid4().hex
        env = {**os.environ, "ONPOLICY_RUN_ID": self.run_id,
               "PYTHONPATH": os.pathsep.join([str(REPO / "integration"),
                                              os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, "-m", "onpolicy.cli", "e2e", "--config", str(CONFIG), "--out",
               str(out), "--steps", str(steps), "--set", "run.progress=false",
               "--set", "run.wandb_mode=offline", *args]  # fmt: skip
        self.log = out.parent / f"{log or out.name}.log"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=REPO, preexec_fn=_default_sigint)  # fmt: skip
        self.listeners: set[tuple[str, int, str]] = set()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._listen, daemon=True)
        self._watch.start()

    def _listen(self) -> None:
        import psutil

        while not self._stop.is_set():
            pids = set(run_processes(self.run_id)) | {self.proc.pid}
            try:
                conns = psutil.net_connections(kind="inet")
            except psutil.Error:
                conns = []
            for c in conns:
                if c.status == psutil.CONN_LISTEN and c.pid in pids:
                    try:
                        name = psutil.Process(c.pid).name()
                    except psutil.Error:
                        name = "?"
                    self.listeners.add((c.laddr.ip, c.laddr.port, name))
            time.sleep(1.0)

    def wait(self, timeout: float = 900) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._stop.set()
            self._watch.join()
            self._log.close()
        return self.proc.returncode

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> list[dict]:
        from onpolicy.grpo.metrics import read_metrics

        return read_metrics(self.out / "metrics.jsonl")

    def check_clean(self) -> None:
        """No process of the run is left (the driver reaps; this checks it did)."""
        left = run_processes(self.run_id)
        assert not left, f"processes of the run left after exit: {left}\n{self.text[-3000:]}"


def steady(row: dict) -> dict:
    """A step's metrics without the wall times (which differ between runs)."""
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def weights(out: Path, iteration: int) -> dict[str, torch.Tensor]:
    from onpolicy.checkpoint import torch_dist

    return torch_dist.global_tensors(out / "checkpoints" / f"iter_{iteration:07d}")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    from onpolicy.bits import as_bits

    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(as_bits(a[k]), as_bits(b[k]))]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def assert_on_policy(run: Run, steps: int) -> list[dict]:
    rows = run.metrics()
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), run.text[-3000:]
    for r in rows:
        assert r[ABS_DIFF] == 0.0 and r[KL] == 0.0, r
        assert r["train/logprob_equal_frac"] == 1.0 and r["train/tokens_compared"] > 0, r
        assert r["train/routing_mismatch"] == 0.0 and r["train/routing_rows"] > 0, r
        assert r["weight_version"] == r["step"], r
        assert r["rollout/weight_version"] == ("default" if r["step"] == 1 else
                                               str(r["step"] - 1)), r  # fmt: skip
    return rows


# --- the runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """`base`, then `replay` and `killed` (+ its resume), shared by the tests below."""
    root = tmp_path_factory.mktemp("e2e")
    out: dict[str, Run] = {}
    base = Run(root / "base", "--set", "run.checkpoint_every=1")
    base.wait()
    out["base"] = base
    replay = Run(root / "replay", "--set", "run.checkpoint_every=2")
    replay.wait()
    out["replay"] = replay

    killed = Run(root / "killed", "--set", "run.checkpoint_every=1")
    latest = killed.out / "checkpoints" / "latest"
    deadline = time.monotonic() + 900
    while killed.proc.poll() is None and time.monotonic() < deadline:
        if latest.exists() and latest.read_text().strip() == "1":
            pid = json.loads((killed.out / "actors.json").read_text())["trainer rank 3"]
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    killed.wait()
    out["killed"] = killed
    resumed = Run(root / "killed", "--resume", "--set", "run.checkpoint_every=1", log="resumed")
    resumed.wait()
    out["resumed"] = resumed
    return out


def test_tiny_e2e_is_on_policy_at_every_step(runs):
    base = runs["base"]
    assert base.proc.returncode == 0, base.text[-4000:]
    rows = assert_on_policy(base, 2)
    assert all(r["grad_norm"] > 0 and r["reward/std"] > 0 for r in rows), rows
    text = base.text
    assert "step 1/2 | abs_diff 0.0 | kl 0.0" in text and "step 2/2 | abs_diff 0.0" in text, text
    assert "abs_diff" in text.split("step 2/2")[-1] and "done in" in text, text[-2000:]
    base.check_clean()


def test_nothing_listens_beyond_loopback(runs):
    base = runs["base"]
    names = {n for _, _, n in base.listeners}
    # The run's listeners were seen: Ray's head and the run's own processes.
    assert {"gcs_server", "raylet"} <= names, base.listeners
    assert any(n.startswith("ray::TrainerActor") for n in names), base.listeners
    wild = {x for x in base.listeners
            if not ipaddress.ip_address(x[0].removeprefix("::ffff:")).is_loopback}  # fmt: skip
    assert not wild, f"listening beyond loopback: {sorted(wild)}"


def test_the_same_seed_gives_the_same_metrics_and_weights(runs):
    base, replay = runs["base"], runs["replay"]
    assert replay.proc.returncode == 0, replay.text[-4000:]
    assert [steady(r) for r in replay.metrics()] == [steady(r) for r in base.metrics()]
    assert_same_weights(weights(base.out, 2), weights(replay.out, 2))
    replay.check_clean()


def test_a_killed_actor_stops_the_run_and_resume_continues_bit_for_bit(runs):
    killed, resumed, base = runs["killed"], runs["resumed"], runs["base"]
    assert killed.proc.returncode == 3, killed.text[-4000:]
    assert "trainer rank 3 died" in killed.text, killed.text[-4000:]
    killed.check_clean()
    assert resumed.proc.returncode == 0, resumed.text[-4000:]
    assert "resumed at step 1" in resumed.text, resumed.text[-3000:]
    # The step-1 line from before the kill, then the resumed step 2: the uninterrupted run's.
    assert [steady(r) for r in resumed.metrics()] == [steady(r) for r in base.metrics()]
    assert_same_weights(weights(base.out, 2), weights(resumed.out, 2))
    resumed.check_clean()


def test_the_stock_rollout_breaks_the_assertion_at_step_1(tmp_path):
    """The negative control: SGLang's own CPU path samples; the trainer's exact log-probs
    differ, and the run stops at step 1 naming the first differing token in hex; `--bisect`
    reruns that sample on both engines with captures and names the first op that differs."""
    run = Run(tmp_path / "stock", "--bisect", "--set", "grpo.rollout_path=stock",
              "--set", "grpo.routing_check=false")  # fmt: skip
    assert run.wait() == 1, run.text[-4000:]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [1] and rows[0][ABS_DIFF] > 0, rows
    v = json.loads((run.out / "violation.json").read_text())
    first = v["first_mismatch"]
    assert first["rollout_hex"] != first["trainer_hex"], first
    assert f"token id {first['token']}" in run.text and first["rollout_hex"] in run.text
    assert "true-on-policy broken" in run.text
    bisect = [ln for ln in run.text.splitlines() if ln.startswith("bisect: ")]
    assert len(bisect) == 1 and f"sample {first['sample']}: first divergence: layer " in bisect[0]
    assert " position " in bisect[0] and "0x" in bisect[0], bisect
    assert (run.out / "bisect" / f"step1-sample{first['sample']}" / "trainer").is_dir()
    run.check_clean()


def test_ctrl_c_tears_down(tmp_path):
    run = Run(tmp_path / "interrupted", steps=4)
    jsonl = run.out / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while run.proc.poll() is None and time.monotonic() < deadline:
        if jsonl.exists() and jsonl.read_text().count("\n") >= 1:
            run.proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    assert run.wait() == 130, run.text[-4000:]
    assert "interrupted; tearing down" in run.text
    run.check_clean()


def test_the_reward_rises(tmp_path):
    """Colocated this time: 2 engines on the trainer's 4 ranks (TP2 EP2 SP), weights through
    shared-memory handles (the tensor transport). The band task with one band (answer with ids
    below 200), 64 samples a step at lr 1e-2: the random policy's 0.2 climbs after about ten
    steps (measured: 0.20 -> 0.64 by step 15)."""
    steps = 15
    sets = ["training.world=4", "training.pp=1", "rollout.colocate=true", "sync.transport=tensor",
            "task.num_bands=1", "optimizer.lr=1e-2", "grpo.prompts_per_step=8",
            "grpo.samples_per_prompt=8"]  # fmt: skip
    run = Run(tmp_path / "learning", *(x for c in sets for x in ("--set", c)), steps=steps)
    assert run.wait(1800) == 0, run.text[-4000:]
    rows = assert_on_policy(run, steps)
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.15, [round(r["reward/mean"], 3) for r in rows]
    run.check_clean()
