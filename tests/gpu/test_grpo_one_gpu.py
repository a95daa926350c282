"""`onpolicy e2e --config configs/one-gpu.toml` on one GPU: Megatron at world 1 (NCCL,
distributed optimizer) and one colocated exact SGLang engine (TP1, decode in CUDA graphs),
weights synced as CUDA IPC handles, the engine's memory released while the trainer trains.

- `base`: 5 steps; every step's abs_diff, kl and routing mismatch are 0, the synced weights'
  digests verified; each phase's lowest and peak GPU memory is recorded, and the engine's
  release frees its weights and KV pool; after the run no process of it is left and the GPU
  uses no more memory than before it;
- `stopped` + `resumed`: 2 steps and a checkpoint, then `--resume` to step 5: the uninterrupted
  run's metrics, bit for bit, among them the digest of the weights every engine holds after each
  step's sync. Both run without the compile warm-up, which `base` runs: the warm-up changes no
  bit of any step;
- `stock`: the rollout on SGLang's stock CUDA path (the negative control) stops at step 1 naming
  the first differing token in hex, and `--bisect` names a layer and an op;
- `interrupted`: Ctrl-C after step 1 gives exit 130 and the same clean state.

Each run is the CLI in its own process (tests/e2e/cli_run.py). Needs Ray and torch-memory-saver
on the host (docs/gpu-host.md: `gpu_lean install-loop`), and about 55 GB of disk: the seeded
checkpoint (6.2 GB, written by `base`, then read by the other runs through model.hf_path) and one
checkpoint with the optimizer's state (43 GB: bf16 weights, fp32 main weights, two Adam moments).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from cli_run import (  # noqa: E402
    Run,
    assert_on_policy,
    sets,
    steady,
    stopped_on_error,
)
from onpolicy.grpo.memory import gpu_memory_used  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(3000)]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "one-gpu.toml"
STEPS = 5
SCORE, TRAIN = "compile/score_kernels", "compile/train_kernels"
"""Triton kernels trainer rank 0 compiled or loaded in a step's scoring and update."""
COLD = ('grpo.compile_warmup="never"',)
"""No compile warm-up before step 1."""
NONDETERMINISTIC = "does not have a deterministic implementation"
"""torch's warning for an op without a deterministic kernel, under warn_only."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The compile caches, shared by every run of the module."""
    return tmp_path_factory.mktemp("one-gpu-cache")


@pytest.fixture(scope="module")
def base(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("one-gpu-e2e")
    before = gpu_memory_used()
    with stopped_on_error():
        run = Run(CONFIG, root / "base", steps=STEPS, cache=cache)
        run.wait(timeout=2400)
    return run, before, gpu_memory_used()


@pytest.fixture(scope="module")
def seeded(base, tmp_path_factory) -> Path:
    """configs/one-gpu.toml with model.hf_path at the checkpoint `base` seeded, in place of its
    [model.tiny] table: the same model, written once."""
    run = base[0]
    found = sorted(run.out.glob("tiny-seed0-*"))
    assert len(found) == 1 and (found[0] / "config.json").is_file(), found
    text = re.sub(r"\n\[model\.tiny\]\n(?:[^\[\n][^\n]*\n|\n)*", "\n", CONFIG.read_text())
    assert "[model.tiny]" not in text and "\n[model]\n" in text
    text = text.replace("\n[model]\n", f"\n[model]\nhf_path = {json.dumps(str(found[0]))}\n")
    path = tmp_path_factory.mktemp("one-gpu-config") / "one-gpu-seeded.toml"
    path.write_text(text)
    return path


def test_every_step_is_on_policy_on_one_gpu(base):
    run, before, after = base
    assert run.code == 0, run.text[-5000:]
    rows = run.metrics()
    assert_on_policy(rows, STEPS, run.text)
    for r in rows:
        assert r["sync/verified_boxes"] > 0 and r["sync/bytes"] > 0, r
        assert len(r["sync/weights_sha256"]) == 64, r
        peaks = {k: v for k, v in r.items() if k.startswith("memory/")}
        print(f"step {r['step']}: time/step_s {r['time/step_s']:.1f}, time/sync_s "
              f"{r['time/sync_s']:.2f} (verify {r['time/sync_verify_s']:.2f}), " + ", ".join(
            f"{k} {v}" for k, v in sorted(peaks.items())))  # fmt: skip
        assert r["time/release_s"] > 0 and r["time/resume_s"] > 0, r  # colocated: released
        assert {f"memory/{p}_peak_mib" for p in ("rollout", "score", "release", "train",
                                                 "resume", "sync")} <= set(peaks), r  # fmt: skip
        # The release frees the engine's weights and its KV pool: the GPU's memory in use,
        # read just before and just after it (the trainer idle), drops by at least the synced
        # weights plus SGLang's KV pool (its GB to 3 decimals: up to 1 MiB off, rounded).
        want = (r["sync/bytes"] >> 20) + r["memory/engine_kv_mib"] - 2
        assert r["memory/engine_kv_mib"] > 0 and r["memory/released_mib"] >= want, (want, r)
    # The trainer's deterministic setting warns, naming the op, where torch has no deterministic
    # kernel; training would then not repeat, and a resume would not continue this run.
    warned = [ln for ln in run.text.splitlines() if NONDETERMINISTIC in ln]
    assert not warned, warned[:5]
    # every step trained: each sync gave the engine other weights
    assert len({r["sync/weights_sha256"] for r in rows}) == STEPS, rows
    assert "GPU memory after teardown" in run.text, run.text[-3000:]
    assert all(a <= b for a, b in zip(after, before, strict=True)), (before, after)
    run.check_clean()


def test_the_trainer_warm_up_leaves_its_steps_nothing_to_compile(base):
    """Before step 1 the trainers scored and trained on the warm-up batches
    (`grpo.compile_warmup = "cuda"`, the default), so no step's scoring or update compiled or
    loaded a Triton kernel (`compile/score_kernels`, `compile/train_kernels`, counted in trainer
    rank 0's process).
    The Ctrl-C run below, without the warm-up, is the control: its step 1 loads kernels in
    both phases."""
    run = base[0]
    assert run.code == 0, run.text[-3000:]
    warm = [ln for ln in run.text.splitlines() if "trainer compile warm-up" in ln]
    assert warm, run.text[-3000:]
    rows = run.metrics()
    print(warm[0], [(r["step"], r.get(SCORE), r.get(TRAIN), r["time/score_s"],
                     r["time/train_s"]) for r in rows])  # fmt: skip
    assert [(r.get(SCORE), r.get(TRAIN)) for r in rows] == [(0, 0)] * STEPS, rows


def test_a_resume_after_step_2_continues_bit_for_bit(base, seeded, cache, tmp_path):
    run = base[0]
    assert run.code == 0, run.text[-3000:]
    with stopped_on_error():
        stopped = Run(seeded, tmp_path / "resumed", *sets("run.checkpoint_every=2", *COLD),
                      steps=2, log="stopped", cache=cache)  # fmt: skip
        assert stopped.wait(timeout=1800) == 0, stopped.text[-4000:]
        assert stopped.latest() == 2
        resumed = Run(seeded, tmp_path / "resumed", "--resume",
                      *sets("run.checkpoint_every=0", *COLD), steps=STEPS,
                      cache=cache)  # fmt: skip
        assert resumed.wait(timeout=1800) == 0, resumed.text[-4000:]
    assert "resumed at step 2" in resumed.text, resumed.text[-3000:]
    assert "trainer compile warm-up" in run.text, run.text[-3000:]
    assert "trainer compile warm-up" not in stopped.text + resumed.text, resumed.text[-3000:]
    rows, want = resumed.metrics(), run.metrics()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    # The last step's digest is the final weights every engine holds, bit for bit.
    assert rows[-1]["sync/weights_sha256"] == want[-1]["sync/weights_sha256"]
    assert [steady(r) for r in rows] == [steady(r) for r in want]
    resumed.check_clean()
    shutil.rmtree(resumed.out)  # 43 GB of optimizer state


def test_the_stock_cuda_rollout_stops_at_step_1_and_bisect_names_the_op(seeded, cache, tmp_path):
    overrides = sets("grpo.rollout_path=stock", "grpo.routing_check=false")
    with stopped_on_error():
        run = Run(seeded, tmp_path / "stock", "--bisect", *overrides, steps=STEPS, cache=cache)
        code = run.wait(timeout=1800)
    assert code == 1, run.text[-4000:]
    rows = run.metrics()
    assert [r["step"] for r in rows] == [1] and rows[0]["train/train_rollout_logprob_abs_diff"] > 0
    first = json.loads((run.out / "violation.json").read_text())["first_mismatch"]
    assert first["rollout_hex"] != first["trainer_hex"], first
    assert f"token id {first['token']}" in run.text and first["rollout_hex"] in run.text
    bisect = [ln for ln in run.text.splitlines() if ln.startswith("bisect: ")]
    assert len(bisect) == 1 and f"sample {first['sample']}: first divergence: layer " in bisect[0]
    assert " position " in bisect[0] and "0x" in bisect[0], bisect
    print(bisect[0])
    run.check_clean()


def test_ctrl_c_after_step_1_exits_130_and_leaves_nothing(seeded, cache, tmp_path):
    """Ctrl-C after step 1: exit 130, no process of the run left, the GPU's memory as before.
    The run has no compile warm-up: its step 1 loads the kernels the warm-up would have
    (the control of the warm-up test above)."""
    before = gpu_memory_used()
    with stopped_on_error():
        run = Run(seeded, tmp_path / "interrupted", *sets(*COLD),
                  steps=STEPS, cache=cache)  # fmt: skip
        rows = run.out / "metrics.jsonl"
        assert run.until(lambda: rows.is_file() and rows.read_text().count("\n") >= 1), run.text
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(timeout=600)
    assert code == 130, run.text[-4000:]
    first = run.metrics()[0]
    assert "trainer compile warm-up" not in run.text, run.text[-3000:]
    assert first[SCORE] > 0 and first[TRAIN] > 0, first
    after = gpu_memory_used()
    assert all(a <= b for a, b in zip(after, before, strict=True)), (before, after)
    run.check_clean()
