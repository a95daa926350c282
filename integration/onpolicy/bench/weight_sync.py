"""Weight sync on CPU: time and bytes per sync of the tiny model, and what Qwen3-30B-A3B moves.

    python -m onpolicy.bench.weight_sync [--reps 3] [--bucket-mib 1] [--out FILE]

`--out` writes the section HEADING of FILE (replaced on a re-run).

One exact SGLang engine (TP2 EP2, the tiny-cpu rollout) starts from the tiny seeded checkpoint;
a torchrun trainer at the tiny-cpu layout (world 4, TP2 EP2 SP, gloo) then runs, per transport,
one warm-up and `--reps` timed syncs (`onpolicy.weights.WeightSync.sync`: gather, buckets,
session, version) and one `verify`. The gather alone (no engine) is timed as well. The
Qwen3-30B-A3B row is arithmetic: its HF tensor bytes in bf16, and the time they take at the
measured CPU rate and at given link rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

from onpolicy.bench import commit, write_section
from onpolicy.layout import ParallelLayout

HEADING = "## Weight sync on CPU: Megatron -> SGLang"
"""The section this benchmark owns in docs/benchmarks.md."""
LAYOUT = ParallelLayout(world=4, tp=2, ep=2, sp=True)
"""The trainer layout (tiny-cpu's)."""


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank; rank 0 prints a JSON line of the timings."""
    import torch
    import torch.distributed as dist

    from onpolicy.rollout.host import KEY_ENV, EngineClient
    from onpolicy.train.builder import init_parallel, load_model, set_seed
    from onpolicy.weights import Gatherer, SyncConfig, WeightSync

    layout = LAYOUT
    init_parallel(layout)
    set_seed()
    cfg, model = load_model(args.ckpt, layout, torch.bfloat16)
    gatherer = Gatherer(model, cfg, layout)
    out: dict = {"gather": []}
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in gatherer.iterate():
            pass
        out["gather"].append(time.perf_counter() - t0)
    for transport in ("distributed", "tensor"):
        engines = []
        if dist.get_rank() == 0:
            engines = [EngineClient.connect("engine", args.address_file, os.environ[KEY_ENV])]
        config = SyncConfig(transport=transport, bucket_bytes=args.bucket_bytes)
        sync = WeightSync(gatherer, engines, config)
        times, stats = [], None
        for i in range(args.reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            stats = sync.sync(f"{transport}-{i}")
            if i:
                times.append(time.perf_counter() - t0)
        sync.verify()
        if dist.get_rank() == 0:
            out[transport] = {"times": times, "bytes": stats.bytes, "tensors": stats.tensors,
                              "buckets": stats.buckets}  # fmt: skip
            sync.close()
            engines[0].close()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def qwen3_30b_bytes() -> int:
    """HF tensor bytes of Qwen3-30B-A3B in bf16: what one full sync moves."""
    import math

    from onpolicy.models.hf_layout import hf_tensor_shapes
    from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B

    return 2 * sum(math.prod(s) for s in hf_tensor_shapes(QWEN3_30B_A3B).values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.weight_sync", description=__doc__)
    ap.add_argument("--reps", type=int, default=3, help="timed syncs per transport")
    ap.add_argument("--bucket-mib", type=float, default=1.0, help="bucket byte budget, MiB")
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--address-file", help=argparse.SUPPRESS)
    ap.add_argument("--bucket-bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    import secrets

    import torch

    from onpolicy.models import write_tiny_checkpoint
    from onpolicy.rendezvous import run_group, torchrun
    from onpolicy.rollout.host import KEY_ENV, EngineHost, clean_env

    load = os.getloadavg()[0]
    bucket = int(args.bucket_mib * 2**20)
    with tempfile.TemporaryDirectory(prefix="onpolicy-bench-") as d:
        tmp = Path(d)
        ckpt = write_tiny_checkpoint(tmp / "tiny", seed=0)
        key = secrets.token_hex(16)
        host = EngineHost.start("engine", ckpt, tmp / "host", tp=2, ep=2, key=key)
        try:
            host.wait()
            cmd = torchrun(LAYOUT.world, "-m", "onpolicy.bench.weight_sync", "--worker",
                           "--ckpt", str(ckpt), "--address-file", str(host.address_file),
                           "--bucket-bytes", str(bucket), "--reps", str(args.reps))  # fmt: skip
            env = {**clean_env(), KEY_ENV: key}
            try:  # past the bound, the trainer's launcher and ranks are killed together
                p = run_group(cmd, env=env, timeout=1800, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
            except subprocess.TimeoutExpired as e:
                raise SystemExit(f"the trainer gave no result within 1800 s (killed):"
                                 f"\n{e.stderr[-4000:]}") from None  # fmt: skip
        finally:
            host.stop()
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"trainer exited {p.returncode}:\n{p.stderr[-4000:]}")
    r = json.loads(lines[-1].removeprefix("RESULT "))
    rows = ["| transport | median sync (s) | syncs (s) | tensors | buckets | MiB | MiB/s |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    rates = {}
    for t in ("distributed", "tensor"):
        x = r[t]
        med = statistics.median(x["times"])
        rates[t] = x["bytes"] / med
        rows.append(f"| {t} | {med:.3f} | {', '.join(f'{s:.3f}' for s in x['times'])} | "
                    f"{x['tensors']} | {x['buckets']} | {x['bytes'] / 2**20:.2f} | "
                    f"{rates[t] / 2**20:.1f} |")  # fmt: skip
    gather = statistics.median(r["gather"])
    big = qwen3_30b_bytes()
    intro = (
        f"`python -m onpolicy.bench.weight_sync --reps {args.reps} --bucket-mib "
        f"{args.bucket_mib:g}` (`nox -s bench`): the tiny seeded Qwen3-MoE (bf16) from a trainer "
        "at world 4 TP2 EP2 SP (gloo) into one exact SGLang engine at TP2 EP2; the median of "
        f"{args.reps} syncs after a warm-up, each a whole weight-update session (gather, "
        "buckets, version); "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, the code of commit {commit()}, 1-minute load average "
        f"{load:.1f} before the runs."
    )
    head = f"{HEADING}\n\n" + textwrap.fill(intro, width=96, break_on_hyphens=False,
                                            break_long_words=False)  # fmt: skip
    best = max(rates.values())
    tail = (
        f"The gather alone (every tensor to rank 0, no engine) takes {gather:.3f} s. "
        f"Qwen3-30B-A3B moves {big / 1e9:.1f} GB per sync (its HF tensors in bf16): "
        f"{big / best / 60:.0f} min at this machine's best rate above, "
        f"{big / 50e9:.1f} s at 50 GB/s and {big / 400e9:.2f} s at 400 GB/s (link rates, not "
        "measured here)."
    )
    text = head + "\n\n" + "\n".join(rows) + "\n\n" + textwrap.fill(tail, width=96) + "\n"
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


if __name__ == "__main__":
    main()
