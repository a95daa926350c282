"""One torchrun job of PPO-clip training on the patched megatron-core (onpolicy.train.step).

Each run in --runs (DTYPE:SEED) builds the exact-spec model, loads the tiny HF checkpoint into
this rank's shard, wraps it in DDP + Megatron's optimizer, takes the global batch of SEED,
scores it with the forward-only `logprobs`, adds seeded noise to make the old log-probs (the
ratio spreads over both clip bounds) and the KL term's reference log-probs, deals it out with
`policy_micro_batches`, then
- --mode grad: one forward/backward; writes the finalized gradient of every parameter;
- --mode train: --steps optimizer steps; writes every parameter after them.
Each rank writes --out/RUN/rank{r}.pt: its coordinates, the global batch, the step results,
and its gradients or parameters by Megatron name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.builder import build_model, init_parallel, set_seed
from onpolicy.train.hf_megatron import hf_to_megatron
from onpolicy.train.logprobs import logprobs
from onpolicy.train.loss import PPOClipConfig
from onpolicy.train.step import (
    OptimizerSettings,
    forward_backward,
    policy_micro_batches,
    setup_training,
    train_step,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LENGTHS = (13, 9, 17, 7)
"""Tokens per sequence of the global batch."""
MICRO_BATCH_TOKENS = 24
"""Packing budget: two sequences a micro-batch here, so packing and several micro-batches are
both exercised."""
PROMPT = 3
"""Prompt tokens per sequence: the predictions of prompt tokens are masked out of the loss."""
LOSS = PPOClipConfig(eps_clip_low=0.2, eps_clip_high=0.28, kl_coef=0.1)
"""Clip-higher and a KL penalty against a reference policy."""
OLD_NOISE, REF_NOISE = 0.3, 0.2
"""Std of the seeded noise added to the scored log-probs to make the old ones (ratios beyond
both clip bounds) and the reference ones (a KL term with a gradient)."""


def global_batch(vocab: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Sequences, loss masks, per-token advantages and log-prob noise (len - 1 each)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"sequences": [], "loss_masks": [], "advantages": [],
                                          "old_noise": [], "ref_noise": []}  # fmt: skip
    for n in LENGTHS:
        out["sequences"].append(torch.randint(0, vocab, (n,), generator=g))
        mask = torch.ones(n - 1)
        mask[: PROMPT - 1] = 0
        out["loss_masks"].append(mask)
        out["advantages"].append(
            torch.randn((), generator=g) + 0.1 * torch.randn(n - 1, generator=g)
        )
        out["old_noise"].append(OLD_NOISE * torch.randn(n - 1, generator=g))
        out["ref_noise"].append(REF_NOISE * torch.randn(n - 1, generator=g))
    return out


def scored(chunks, batch: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Forward-only log-probs at the current weights (the driver's), on every rank."""
    values = [logprobs(chunks, batch["sequences"], micro_batch_tokens=MICRO_BATCH_TOKENS)]
    dist.broadcast_object_list(values, src=0)
    return values[0]


def one_run(args, layout: ParallelLayout, cfg: Qwen3MoeConfig, hf: dict, dtype_name: str,
            seed: int) -> dict:  # fmt: skip
    dtype = DTYPES[dtype_name]
    rank = dist.get_rank()
    set_seed()
    model = build_model(cfg, layout, dtype, weights=hf_to_megatron(cfg, hf, layout, rank, dtype))
    settings = OptimizerSettings(lr=args.lr, distributed_optimizer=args.distopt, clip_grad=1.0)
    chunks, optimizer = setup_training(model, settings)
    batch = global_batch(cfg.vocab_size, seed)
    scores = scored(chunks, batch)
    olds = [lp + noise for lp, noise in zip(scores, batch["old_noise"], strict=True)]
    refs = [lp + noise for lp, noise in zip(scores, batch["ref_noise"], strict=True)]
    mbs = policy_micro_batches(
        batch["sequences"], olds, batch["advantages"], batch["loss_masks"], ref_logprobs=refs,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
    )  # fmt: skip
    record: dict = {"coords": layout.coords(rank), "dtype": dtype_name, "seed": seed,
                    "loss_config": asdict(LOSS), "sequences": batch["sequences"],
                    "old_logprobs": olds, "ref_logprobs": refs, "advantages": batch["advantages"],
                    "loss_masks": batch["loss_masks"], "micro_batches": len(mbs)}  # fmt: skip
    if args.mode == "grad":
        for c in chunks:
            c.train()
        sums = forward_backward(chunks, mbs, loss=LOSS)
        record["sums"] = {k: float(v) for k, v in sums.items()}
        record["grads"] = {n: p.main_grad.detach().clone()
                           for n, p in model.named_parameters()}  # fmt: skip
    else:
        steps = [train_step(chunks, optimizer, mbs, loss=LOSS) for _ in range(args.steps)]
        record["steps"] = [{"loss": s.loss, "grad_norm": s.grad_norm, "num_tokens": s.num_tokens,
                            **s.metrics} for s in steps]  # fmt: skip
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def main(args: argparse.Namespace) -> None:
    layout = ParallelLayout.from_args(args)
    init_parallel(layout)
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    hf = read_hf_checkpoint(args.ckpt, strict=False).tensors
    if dist.get_rank() == 0:
        import megatron.core

        print(f"megatron.core from {os.path.dirname(megatron.core.__file__)}", flush=True)
    for run in args.runs:
        dtype_name, seed = run.split(":")
        record = one_run(args, layout, cfg, hf, dtype_name, int(seed))
        out = Path(args.out) / run.replace(":", "-")
        out.mkdir(parents=True, exist_ok=True)
        torch.save(record, out / f"rank{dist.get_rank()}.pt")
        dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=["grad", "train"], required=True)
    ap.add_argument("--runs", nargs="+", default=["fp32:0"], help="DTYPE:SEED, one run each")
    ParallelLayout.add_arguments(ap)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    main(ap.parse_args())
