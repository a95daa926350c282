"""The tiny GRPO run's wall time, split per phase: `python -m onpolicy.bench.e2e [--out FILE]`.

Runs `onpolicy e2e --config configs/tiny-cpu.toml` twice in fresh run directories: first with
an empty compile cache (what a fresh machine pays), then with the cache the first run left.
Each run's setup (Ray, actors, engines), per-step phases (rollout, scoring + update, weight
sync) and teardown come from its times.json and metrics.jsonl. The goal: the whole tiny run
within 5 minutes on the 2-core CPU machine.
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
GOAL_S = 300.0


def one_run(out: Path, cache: Path, steps: int) -> dict:
    path = os.pathsep.join([str(REPO / "integration"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "onpolicy.cli", "e2e", "--config",
           str(REPO / "configs" / "tiny-cpu.toml"), "--out", str(out), "--steps", str(steps),
           "--set", "run.progress=false", "--set", "run.wandb_mode=offline",
           "--set", f"run.cache_dir={cache}"]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"onpolicy e2e exited {p.returncode}:\n{p.stderr[-4000:]}")
    from onpolicy.grpo.metrics import read_metrics

    return {"times": json.loads((out / "times.json").read_text()),
            "steps": read_metrics(out / "metrics.jsonl")}  # fmt: skip


def rows(label: str, run: dict) -> list[str]:
    t, steps = run["times"], run["steps"]
    out = [f"| {label} | setup | {t['setup_s']:.1f} | Ray {t['ray_init_s']:.1f}, slowest trainer "
           f"rank {t['trainer_setup_s']:.1f} (engines start alongside) |"]  # fmt: skip
    for s in steps:
        out.append(f"| {label} | step {s['step']} | {s['time/step_s']:.1f} | rollout "
                   f"{s['time/rollout_s']:.1f}, score + update {s['time/train_s']:.1f} (score "
                   f"{s['time/score_s']:.1f}), sync {s['time/sync_s']:.1f}; abs_diff "
                   f"{s['train/train_rollout_logprob_abs_diff']!r}, kl "
                   f"{s['train/train_rollout_kl']!r} |")  # fmt: skip
    out.append(f"| {label} | teardown | {t['teardown_s']:.1f} | |")
    verdict = "within" if t["wall_s"] <= GOAL_S else "over"
    out.append(f"| {label} | **whole run** | **{t['wall_s']:.1f}** | {verdict} the "
               f"{GOAL_S:.0f} s goal |")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.e2e", description=__doc__)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="onpolicy-bench-e2e-") as d:
        tmp = Path(d)
        cold = one_run(tmp / "cold", tmp / "cache", args.steps)
        warm = one_run(tmp / "warm", tmp / "cache", args.steps)
    import torch

    date = datetime.date.today().isoformat()
    text = "\n".join([
        HEADING, "",
        f"`python -m onpolicy.bench.e2e --steps {args.steps}` (`nox -s bench`): `onpolicy e2e` "
        "on configs/tiny-cpu.toml (real Ray; Megatron TP2 PP2 EP2 SP on 8 ranks, two exact "
        "SGLang engines of TP2 EP2, gloo), first with an empty compile cache, then with the "
        f"cache the first run left; {date}, torch {torch.__version__}, {os.cpu_count()} CPU "
        f"cores, the code of commit {commit()}, 1-minute load average {load:.1f} before the "
        "runs. Seconds; the goal is the whole run within 5 minutes.", "",
        "| cache | phase | s | split |", "|---|---|---|---|",
        *rows("cold", cold), *rows("warm", warm),
    ])  # fmt: skip
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


if __name__ == "__main__":
    main()
