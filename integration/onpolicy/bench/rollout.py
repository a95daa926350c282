"""Rollout throughput on CPU: the exact SGLang engine against the stock one, on the tiny model.

    python -m onpolicy.bench.rollout [--prompts 8] [--new-tokens 32] [--reps 5] [--out FILE]

`--out` writes the section HEADING of FILE (replaced on a re-run).

Each engine (TP1, the tiny seeded Qwen3-MoE, bf16) runs in its own process
(`onpolicy.rollout.engine.launch`): one warm-up batch, then `--reps` timed batches of
`--prompts` prompts x `--new-tokens` sampled tokens (EOS ignored, log-probs returned). The
figure is generated tokens per second of the median batch. The stock engine is the same
engine without `rl_on_policy_target` and with SGLang's torch_native attention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from onpolicy.bench import commit, write_section

HEADING = "## Rollout throughput on CPU: exact vs stock engine"
"""The section this benchmark owns in docs/benchmarks.md."""


def measure(args: argparse.Namespace) -> None:
    """The timed part, inside the engine's process: one JSON line of batch times on stdout."""
    import torch

    from onpolicy.rollout.engine import RolloutRequest, launch, sample

    g = torch.Generator().manual_seed(0)
    lengths = [4 + (7 * i) % 13 for i in range(args.prompts)]
    prompts = [torch.randint(0, 990, (n,), generator=g).tolist() for n in lengths]
    req = RolloutRequest(prompts=prompts, new_tokens=args.new_tokens, temperature=1.0)
    engine = launch(args.ckpt, 1, 1, args.dtype, exact=args.engine == "exact")
    try:
        sample(engine, req)  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            sample(engine, req)
            times.append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
    print("TIMES " + json.dumps(times), flush=True)


def run_engine(engine: str, ckpt: Path, args: argparse.Namespace, tmp: Path) -> list[float]:
    from onpolicy.rollout.engine import engine_env

    cmd = [sys.executable, "-m", "onpolicy.bench.rollout", "--measure", engine, "--ckpt",
           str(ckpt), "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
           "--reps", str(args.reps), "--dtype", args.dtype]  # fmt: skip
    env = engine_env(1, tmp / engine, base=os.environ)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [x for x in p.stdout.splitlines() if x.startswith("TIMES ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{engine} engine exited {p.returncode}:\n{p.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("TIMES "))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.rollout", description=__doc__)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per prompt")
    ap.add_argument("--reps", type=int, default=5, help="timed batches (the median is kept)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    ap.add_argument("--measure", choices=["exact", "stock"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        args.engine = args.measure
        measure(args)
        return
    import torch

    from onpolicy.models import write_tiny_checkpoint

    load = os.getloadavg()[0]  # the machine may be shared; the figure says so
    with tempfile.TemporaryDirectory(prefix="onpolicy-bench-") as d:
        tmp = Path(d)
        ckpt = write_tiny_checkpoint(tmp / "tiny", seed=0)
        times = {e: run_engine(e, ckpt, args, tmp) for e in ("stock", "exact")}
    tokens = args.prompts * args.new_tokens
    rate = {e: tokens / statistics.median(t) for e, t in times.items()}
    ratio = rate["exact"] / rate["stock"]
    rows = [
        "| engine | median batch (s) | tokens/s | batches (s) |",
        "|---|---|---|---|",
    ] + [
        f"| {e} | {statistics.median(t):.3f} | {rate[e]:.1f} | {', '.join(f'{x:.3f}' for x in t)} |"
        for e, t in times.items()
    ]
    intro = (
        f"`python -m onpolicy.bench.rollout --prompts {args.prompts} --new-tokens "
        f"{args.new_tokens} --reps {args.reps}` (`nox -s bench`): one SGLang engine at TP1 on the "
        f"tiny seeded Qwen3-MoE ({args.dtype}), {args.prompts} prompts x {args.new_tokens} sampled "
        f"tokens per batch (log-probs returned), the median of {args.reps} batches after a "
        f"warm-up; {time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, the code of commit {commit()}, 1-minute load average "
        f"{load:.1f} before the runs. The "
        "stock engine is the same engine without `rl_on_policy_target` and with SGLang's "
        "torch_native attention."
    )
    head = f"{HEADING}\n\n"
    head += textwrap.fill(intro, width=96, break_on_hyphens=False, break_long_words=False)
    tail = (
        f'The exact engine (`rl_on_policy_target="onpolicy"`) runs {ratio:.2f}x the stock '
        "engine's tokens/s."
    )
    text = head + "\n\n" + "\n".join(rows) + "\n\n" + tail + "\n"
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


if __name__ == "__main__":
    main()
