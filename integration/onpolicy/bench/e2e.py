"""A GRPO run's wall time, throughput and peak memory per phase:
`python -m onpolicy.bench.e2e [--config FILE] [--steps N] [--out FILE]`.

Runs `onpolicy e2e --config FILE` (default configs/tiny-cpu.toml) twice in fresh run
directories: first with an empty compile cache (what a fresh machine pays), then with the cache
the first run left. Each run's setup (Ray, actors, engines), per-step phases (rollout, score,
release, train, resume, weight sync), tokens per second of the rollout and of the trainer, the
peak memory of each phase (metrics.jsonl's memory/*: GPU memory in use on CUDA, the run's
summed resident set size on CPU) and teardown come from its times.json and metrics.jsonl. The
goal for the tiny CPU run: within 5 minutes on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from onpolicy.bench import commit, write_section

REPO = Path(__file__).resolve().parents[3]
HEADING = "## The tiny GRPO run on CPU: wall time per phase"
GPU_HEADING = "## The GRPO run on one GPU: wall time, throughput and memory per phase"
GOAL_S = 300.0
PHASES = ("rollout", "score", "release", "train", "resume", "sync")


def one_run(config: Path, out: Path, cache: Path, steps: int) -> dict:
    path = os.pathsep.join([str(REPO / "integration"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "onpolicy.cli", "e2e", "--config",
           str(config), "--out", str(out), "--steps", str(steps),
           "--set", "run.progress=false", "--set", "run.wandb_mode=offline",
           "--set", f"run.cache_dir={cache}"]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"onpolicy e2e exited {p.returncode}:\n{p.stderr[-4000:]}")
    from onpolicy.grpo.metrics import read_metrics

    return {"times": json.loads((out / "times.json").read_text()),
            "steps": read_metrics(out / "metrics.jsonl")}  # fmt: skip


def rows(label: str, run: dict, goal: bool) -> list[str]:
    t, steps = run["times"], run["steps"]
    out = [f"| {label} | setup | {t['setup_s']:.1f} | Ray {t['ray_init_s']:.1f}, slowest trainer "
           f"rank {t['trainer_setup_s']:.1f} (engines start alongside) |"]  # fmt: skip
    for s in steps:
        split = [f"{ph} {s[f'time/{ph}_s']:.1f}" for ph in PHASES if f"time/{ph}_s" in s]
        peaks = [f"{ph} {s[f'memory/{ph}_peak_mib']}" for ph in PHASES
                 if f"memory/{ph}_peak_mib" in s]  # fmt: skip
        out.append(f"| {label} | step {s['step']} | {s['time/step_s']:.1f} | {', '.join(split)}; "
                   f"tokens/s rollout {s['perf/rollout_tokens_per_s']:.0f}, train "
                   f"{s['perf/train_tokens_per_s']:.0f}; peak MiB {', '.join(peaks)}; abs_diff "
                   f"{s['train/train_rollout_logprob_abs_diff']!r}, kl "
                   f"{s['train/train_rollout_kl']!r} |")  # fmt: skip
    out.append(f"| {label} | teardown | {t['teardown_s']:.1f} | |")
    verdict = ("within" if t["wall_s"] <= GOAL_S else "over") + f" the {GOAL_S:.0f} s goal"
    out.append(f"| {label} | **whole run** | **{t['wall_s']:.1f}** | {verdict if goal else ''} |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.e2e", description=__doc__)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.toml"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    args = ap.parse_args(argv)
    from onpolicy.contract import load_config

    cfg = load_config(args.config)  # a bad config stops here, before any run
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="onpolicy-bench-e2e-") as d:
        tmp = Path(d)
        cold = one_run(Path(args.config), tmp / "cold", tmp / "cache", args.steps)
        warm = one_run(Path(args.config), tmp / "warm", tmp / "cache", args.steps)
    import torch

    if cfg.device == "cuda":
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        heading, shape = (
            GPU_HEADING,
            f"{Path(args.config).name} (`[rollout]` and `[training]` there)",
        )
    else:
        where = f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
        heading = HEADING
        shape = ("configs/tiny-cpu.toml (real Ray; Megatron TP2 PP2 EP2 SP on 8 ranks, two exact "
                 "SGLang engines of TP2 EP2, gloo)")  # fmt: skip

    date = datetime.date.today().isoformat()
    memory = "GPU memory in use" if cfg.device == "cuda" else "the run's summed resident set size"
    text = "\n".join([
        heading, "",
        f"`python -m onpolicy.bench.e2e --config {Path(args.config).name} --steps {args.steps}` "
        f"(`nox -s bench`): `onpolicy e2e` on {shape}, first with an empty compile cache, then "
        f"with the cache the first run left; {date}, {where}, the code of commit {commit()}, "
        f"1-minute load average {load:.1f} before the runs. Seconds per phase, tokens per second "
        f"of the rollout (generated) and of the trainer (trained), peak MiB of {memory} per "
        "phase." + (" The goal: the whole run within 5 minutes." if cfg.device == "cpu" else ""),
        "",
        "| cache | phase | s | split |", "|---|---|---|---|",
        *rows("cold", cold, cfg.device == "cpu"), *rows("warm", warm, cfg.device == "cpu"),
    ])  # fmt: skip
    print(text)
    if args.out:
        write_section(Path(args.out), heading, text)


if __name__ == "__main__":
    main()
