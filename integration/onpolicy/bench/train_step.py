"""Training-step time of the exact spec against megatron-core's stock local spec, on CPU/gloo.

One PPO-clip step (`onpolicy.train.step.train_step`: forward, backward, finalize, distributed
Adam) on the seeded tiny Qwen3-MoE, at world 1 and at TP2 + SP, one thread per rank:
- exact: `build_model(spec="exact")`, packed THD micro-batches (`policy_micro_batches`),
  the exact vocab-parallel log-probs (`logprobs.token_logprobs`);
- local: `build_model(spec="local")` (the stock local spec; it has no THD attention), the
  same equal-length sequences as a [b, s] batch per micro-batch, `torch.log_softmax` of the
  TP-gathered logits. Its TP/SP mapping sums are whatever this build's megatron-core runs (the
  patch series routes them to onpolicy's tree); the section says which.
Same tokens, micro-batches, loss and optimizer on both. Each step is timed between barriers;
after --warmup untimed steps, the median (and min, max) of --reps steps is reported.

    python -m onpolicy.bench.train_step [--out docs/benchmarks.md] [--reps 10] [--seqs 8]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onpolicy.bench import commit, write_section
from onpolicy.rendezvous import free_port

HEADING = "## Training step: exact vs local spec (CPU)"
"""The section of docs/benchmarks.md this benchmark owns."""
LAYOUTS = {"world 1": (1, False), "TP2 + SP": (2, True)}
"""Name -> (TP = world size, sequence parallel)."""


@dataclass(kw_only=True, slots=True)
class Row:
    """One spec at one layout: seconds per training step."""

    layout: str
    """Layout name (LAYOUTS)."""
    spec: str
    """exact or local."""
    times: list[float]
    """Seconds per timed step."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _batch(args: argparse.Namespace, vocab: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n, length = args.seqs, args.seq_len
    seqs = [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]
    return {
        "sequences": seqs,
        "old": [torch.full((length - 1,), -7.0) for _ in range(n)],
        "adv": [torch.randn(length - 1, generator=g) for _ in range(n)],
        "mask": [torch.ones(length - 1) for _ in range(n)],
    }


def _local_micro_batches(data: dict, per_micro: int) -> list:
    """[b, s] micro-batches of `per_micro` equal-length sequences; the per-token PPO inputs
    flattened row by row, each row's last position (no next token) masked."""
    from onpolicy.train.step import PolicyMicroBatch

    out = []
    for i in range(0, len(data["sequences"]), per_micro):
        rows = slice(i, i + per_micro)
        tokens = torch.stack(data["sequences"][rows])

        def flat(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([torch.cat([v, v.new_zeros(1)]) for v in values]).reshape(-1)

        targets = torch.cat([tokens[:, 1:], tokens.new_zeros(tokens.shape[0], 1)], dim=1)
        out.append(PolicyMicroBatch(
            inputs={"tokens": tokens, "targets": targets.reshape(-1)},
            old_logprobs=flat(data["old"][rows]), advantages=flat(data["adv"][rows]),
            loss_mask=flat(data["mask"][rows]),
        ))  # fmt: skip
    return out


def _local_forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    tokens = inputs["tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)


def _local_logprobs(output: torch.Tensor, inputs: dict, temperature: float) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(output)
    logits = logits.reshape(-1, logits.shape[-1]).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, inputs["targets"][:, None])[:, 0]


def _measure(args, layout, cfg, hf: dict, spec: str) -> list[float]:
    from onpolicy.train.builder import build_model
    from onpolicy.train.hf_megatron import hf_to_megatron
    from onpolicy.train.loss import PPOClipConfig
    from onpolicy.train.step import (
        OptimizerSettings,
        policy_micro_batches,
        setup_training,
        train_step,
    )

    weights = hf_to_megatron(cfg, hf, layout, dist.get_rank(), torch.bfloat16)
    model = build_model(cfg, layout, torch.bfloat16, spec=spec, weights=weights)
    chunks, optimizer = setup_training(model, OptimizerSettings(lr=1e-6))
    data = _batch(args, cfg.vocab_size)
    per_micro = args.seqs // args.micro_batches
    if spec == "exact":
        mbs = policy_micro_batches(data["sequences"], data["old"], data["adv"], data["mask"],
                                   micro_batch_tokens=per_micro * args.seq_len)  # fmt: skip
        kw = {}
    else:
        mbs = _local_micro_batches(data, per_micro)
        kw = {"forward": _local_forward, "logprobs_of": _local_logprobs}
    if len(mbs) != args.micro_batches:
        raise RuntimeError(f"{spec}: {len(mbs)} micro-batches, expected {args.micro_batches}")
    times = []
    for i in range(args.warmup + args.reps):
        dist.barrier()
        start = time.perf_counter()
        train_step(chunks, optimizer, mbs, loss=PPOClipConfig(), **kw)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, world: int, port: int, args, ckpt: str, name: str, queue) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from onpolicy.layout import ParallelLayout
    from onpolicy.models.hf_layout import read_hf_checkpoint
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.rendezvous import tcp_store
    from onpolicy.train.builder import init_parallel, set_seed

    layout = ParallelLayout(world=world, tp=world, sp=LAYOUTS[name][1])
    store = tcp_store("127.0.0.1", port, world, is_master=rank == 0)
    init_parallel(layout, store=store, rank=rank)
    set_seed(0)
    cfg, hf = Qwen3MoeConfig.from_hf(ckpt), read_hf_checkpoint(ckpt, strict=False).tensors
    for spec in ("local", "exact"):
        times = _measure(args, layout, cfg, hf, spec)
        if rank == 0:
            queue.put((spec, times))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def table(rows: list[Row]) -> str:
    """The markdown table: per layout, both specs' step times and the exact / local ratio."""
    out = ["| layout | local spec: median s/step (min-max) | exact spec: median s/step "
           "(min-max) | exact / local |", "|---|---|---|---|"]  # fmt: skip
    for name in LAYOUTS:
        by = {r.spec: r for r in rows if r.layout == name}
        if set(by) != {"local", "exact"}:
            continue
        cells = [f"{by[s].median:.3f} ({min(by[s].times):.3f}-{max(by[s].times):.3f})"
                 for s in ("local", "exact")]  # fmt: skip
        out.append(f"| {name} | {cells[0]} | {cells[1]} | "
                   f"{by['exact'].median / by['local'].median:.2f} |")  # fmt: skip
    return "\n".join(out)


def _mapping_note() -> str:
    """Which sum the local spec's TP/SP mappings run on this build (the patch series may route
    megatron-core's `_reduce` to onpolicy's tree)."""
    from megatron.core.tensor_parallel import mappings

    patched = hasattr(mappings, "onpolicy_tree_all_reduce")
    how = "onpolicy's tree (the patch series routes them)" if patched else "torch.distributed"
    return f"The local spec's TP/SP mapping sums (megatron-core `_reduce`) run {how}."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.train_step", description=__doc__)
    ap.add_argument("--out", help="append a dated markdown section with the table to this file")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per spec and layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the global batch")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    args = ap.parse_args(argv)
    if args.seqs % args.micro_batches:
        ap.error(f"--seqs {args.seqs} must split into --micro-batches {args.micro_batches}")
    from onpolicy.models import write_tiny_checkpoint

    rows: list[Row] = []
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(write_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
        ctx = mp.get_context("spawn")
        for name, (world, _) in LAYOUTS.items():
            queue = ctx.Queue()
            mp.start_processes(_worker, args=(world, free_port(), args, ckpt, name, queue),
                               nprocs=world, join=True, start_method="spawn")  # fmt: skip
            rows += [Row(layout=name, spec=spec, times=t) for spec, t in
                     (queue.get() for _ in range(2))]  # fmt: skip
    lead = (
        f"{datetime.date.today()}, {platform.machine()}, {_cpu()}, torch {torch.__version__}, "
        f"gloo, the code of commit {commit()}. `python -m onpolicy.bench.train_step`: one "
        "PPO-clip step "
        f"(`onpolicy.train.step.train_step`: forward, backward, finalize, distributed Adam) on "
        f"the tiny model, {args.seqs} sequences x {args.seq_len} tokens in "
        f"{args.micro_batches} micro-batches, bf16, one thread per rank, median of {args.reps} "
        f"steps after {args.warmup} warm-up. Exact: the exact spec, packed THD, exact "
        "vocab-parallel log-probs. Local: megatron-core's local spec, the same sequences as "
        "[b, s] micro-batches, `torch.log_softmax` of the TP-gathered logits. " + _mapping_note()
    )
    load.append(os.getloadavg()[0])
    spread = (f"1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the end "
              f"on {os.cpu_count()} cores: other work on the machine widens the min-max "
              "range.")  # fmt: skip
    text = "\n".join([HEADING, "", textwrap.fill(lead, width=100), "", table(rows), "",
                      textwrap.fill(spread, width=100)])  # fmt: skip
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


def _cpu() -> str:
    """CPU model and core count, from /proc/cpuinfo where there is one."""
    model = platform.processor() or "CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} x {os.cpu_count()}"


if __name__ == "__main__":
    main()
