"""Rollout throughput on CUDA: the exact SGLang engine against the stock one, decode graphs on.

    python -m onpolicy.bench.rollout_gpu [--config configs/one-gpu.toml] [--reps 3] [--out FILE]

`--out` writes the section HEADING of FILE (replaced on a re-run).

Each engine (TP1, the config's seeded checkpoint) runs in its own process, as `onpolicy
parity`'s sampler does, with decode batches in CUDA graphs, chunked prefill and the radix cache
on. Every timed batch has prompts no earlier batch had, so the radix cache never shortens a
prefill. The figures, each the median of `--reps` batches after a warm-up of every shape:
- decode tokens/s at B = 1, 16 and 64, prompts of `--context` tokens: B x (N - 1) over the
  time of a batch of N new tokens less that of a batch of 1 new token (its prefill);
- prefill tokens/s of one `--prefill`-token prompt (one new token).
The stock engine is the same engine without `rl_on_policy_target`, with SGLang's triton
attention and its own ops; where sglang-kernel is not installed (the H200 host) its torch ops,
decoding eagerly (their MoE reads expert counts back to the host, which a capture refuses).
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

HEADING = "## Rollout throughput on CUDA: exact vs stock engine"
"""The section this benchmark owns in docs/benchmarks.md."""
BATCHES = (1, 16, 64)
"""Decode batch sizes measured."""
NATIVE = (" (so the stock engine runs SGLang's torch ops and decodes eagerly: their MoE reads "
          "expert counts back to the host, which a graph capture refuses)")  # fmt: skip


def measure(args: argparse.Namespace) -> None:
    """The timed part, inside the engine's process: one JSON line of times on stdout."""
    import torch

    from onpolicy.rollout.engine import RolloutRequest, launch, sample

    g = torch.Generator().manual_seed(0)

    def batch(b: int, length: int, new: int) -> float:
        prompts = [torch.randint(0, args.vocab, (length,), generator=g).tolist() for _ in range(b)]
        req = RolloutRequest(prompts=prompts, new_tokens=new, temperature=1.0)
        t0 = time.perf_counter()  # `sample` returns once the engine has answered every prompt
        sample(engine, req)
        return time.perf_counter() - t0

    room = max(BATCHES) * (args.context + args.new_tokens) + args.prefill + 1024
    graphs = (
        {"disable_cuda_graph": True} if args.eager else {"cuda_graph_max_bs_decode": max(BATCHES)}
    )
    engine = launch(args.ckpt, 1, 1, args.dtype, exact=args.engine == "exact", device="cuda",
                    mem_fraction_static=args.mem_fraction, max_total_tokens=room,
                    **graphs)  # fmt: skip
    try:
        shapes = [(b, args.context, n) for b in BATCHES for n in (1, args.new_tokens)]
        shapes.append((1, args.prefill, 1))
        for s in shapes:  # warm-up: every shape once (kernel variants compile here)
            batch(*s)
        times = {f"{b}x{length}+{n}": [batch(b, length, n) for _ in range(args.reps)]
                 for b, length, n in shapes}  # fmt: skip
    finally:
        engine.shutdown()
    print("TIMES " + json.dumps(times), flush=True)


def run_engine(engine: str, ckpt: Path, args: argparse.Namespace, env: dict[str, str],
               tmp: Path, eager: bool = False) -> dict[str, list[float]]:  # fmt: skip
    cmd = [sys.executable, "-m", "onpolicy.bench.rollout_gpu", "--measure", engine, "--ckpt",
           str(ckpt), "--reps", str(args.reps), "--dtype", args.dtype, "--vocab",
           str(args.vocab), "--context", str(args.context), "--new-tokens",
           str(args.new_tokens), "--prefill", str(args.prefill), "--mem-fraction",
           str(args.mem_fraction)] + (["--eager"] if eager else [])  # fmt: skip
    log = tmp / f"{engine}.log"
    with log.open("w") as f:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True,
                           timeout=1800)  # fmt: skip
    lines = [x for x in p.stdout.splitlines() if x.startswith("TIMES ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{engine} engine exited {p.returncode}:\n{log.read_text()[-4000:]}")
    return json.loads(lines[-1].removeprefix("TIMES "))


def rates(t: dict[str, list[float]], args: argparse.Namespace) -> dict[str, float]:
    """Tokens per second by measure, from the median batch times."""
    m = {k: statistics.median(v) for k, v in t.items()}
    out = {}
    for b in BATCHES:
        decode = m[f"{b}x{args.context}+{args.new_tokens}"] - m[f"{b}x{args.context}+1"]
        out[f"decode B={b}"] = b * (args.new_tokens - 1) / decode
    out[f"prefill {args.prefill}"] = args.prefill / m[f"1x{args.prefill}+1"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.rollout_gpu", description=__doc__)
    root = Path(__file__).resolve().parents[3]
    ap.add_argument("--config", default=str(root / "configs" / "one-gpu.toml"))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of a decode batch")
    ap.add_argument("--new-tokens", type=int, default=65, help="new tokens of a decode batch")
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill prompt")
    ap.add_argument("--reps", type=int, default=3, help="timed batches (the median is kept)")
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="SGLang's mem_fraction_static (the engine has the GPU)")  # fmt: skip
    ap.add_argument("--workdir", help="keep the checkpoint and logs here (default: a temp dir)")
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    ap.add_argument("--measure", choices=["exact", "stock"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        args.engine = args.measure
        measure(args)
        return
    import torch

    from onpolicy.contract import load_config, model_checkpoint, resolve_plan, stock_env
    from onpolicy.rollout.engine import NATIVE_OPS_ENV, engine_env, stock_runs_native_ops

    cfg = load_config(args.config)
    if cfg.device != "cuda":
        raise SystemExit(f"rollout_gpu: {args.config} has device {cfg.device!r}; this bench "
                         "needs a CUDA config (device = 'cuda')")  # fmt: skip
    args.dtype, args.vocab = cfg.model.dtype, cfg.shape.eos_token_id
    with tempfile.TemporaryDirectory(prefix="onpolicy-bench-") as d:
        tmp = Path(args.workdir or d)
        tmp.mkdir(parents=True, exist_ok=True)
        ckpt = model_checkpoint(cfg, tmp)
        base = {**os.environ, **resolve_plan(cfg).rollout_env}
        envs = {"exact": base, "stock": stock_env(base)}
        native = stock_runs_native_ops(cfg.device)  # and decodes eagerly
        if native:
            envs["stock"] = {**envs["stock"], **NATIVE_OPS_ENV}
        times = {e: run_engine(e, ckpt, args, engine_env(1, tmp / e, "cuda", base=envs[e]), tmp,
                               eager=native and e == "stock")
                 for e in ("stock", "exact")}  # fmt: skip
    r = {e: rates(t, args) for e, t in times.items()}
    rows = ["| measure | stock tokens/s | exact tokens/s | exact / stock |", "|---|---|---|---|"]
    for k, exact in r["exact"].items():
        stock = r["stock"][k]
        rows.append(f"| {k} | {stock:.0f} | {exact:.0f} | {exact / stock:.2f} |")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    kernel = "not installed" if native else "installed"
    intro = (
        f"`python -m onpolicy.bench.rollout_gpu --context {args.context} --new-tokens "
        f"{args.new_tokens} --prefill {args.prefill} --reps {args.reps}` (`nox -s bench -- "
        f"--gpu`): one SGLang engine at TP1 on {Path(args.config).name} ({cfg.model.dtype}, "
        f"{cfg.shape.num_hidden_layers} layers of Qwen3-30B-A3B's dims, seeded), decode in CUDA "
        f"graphs, chunked prefill and the radix cache on, log-probs returned; "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {gpu}, torch {torch.__version__}, the code "
        f"of commit {commit()}, sglang-kernel {kernel}{NATIVE if native else ''}. Decode: "
        f"B x {args.new_tokens - 1} tokens "
        f"over the batch time less its prefill's, prompts of {args.context} tokens; prefill: one "
        f"{args.prefill}-token prompt. The median of {args.reps} batches after a warm-up."
    )
    head = f"{HEADING}\n\n" + textwrap.fill(intro, width=96, break_on_hyphens=False,
                                            break_long_words=False)  # fmt: skip
    raw = "Median batch seconds (stock / exact): " + "; ".join(
        f"{k} {statistics.median(times['stock'][k]):.4f} / {statistics.median(v):.4f}"
        for k, v in times["exact"].items()
    )
    text = head + "\n\n" + "\n".join(rows) + "\n\n" + textwrap.fill(raw, width=96) + "\n"
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


if __name__ == "__main__":
    main()
