"""One torchrun job of PPO-clip training on the patched megatron-core (onpolicy.train.step).

Each run in --runs (DTYPE:SEED) builds the model, loads the tiny HF checkpoint into this rank's
shard, wraps it in DDP + Megatron's optimizer, takes the global batch of SEED (sequences dealt
to DP ranks in turn, one micro-batch each), computes old log-probs with a forward-only pass
(plus seeded noise, so the ratio spreads over both clip bounds), then
- --mode grad: one forward/backward; writes the finalized gradient of every parameter;
- --mode train: --steps optimizer steps; writes every parameter after them.
Each rank writes --out/RUN/rank{r}.pt: its coordinates, its micro-batches, the step results,
and the gradients or parameters by Megatron name.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from onpolicy import kernels as K
from onpolicy.checkpoint.hf_megatron import hf_to_megatron
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import load_hf_state_dict
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.loss import PPOClipConfig
from onpolicy.train.megatron_model import build_gpt_model, initialize_parallel_state
from onpolicy.train.step import (
    OptimizerSettings,
    PolicyMicroBatch,
    forward_backward,
    setup_training,
    train_step,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LENGTHS = (12, 8, 16, 6)
"""Tokens per sequence of the global batch (even, so that SP at TP2 splits each one)."""
PROMPT = 3
"""Prompt tokens per sequence: their targets are masked out of the loss."""
LOSS = PPOClipConfig(eps_clip_low=0.2, eps_clip_high=0.28)
OLD_NOISE = 0.3
"""Std of the seeded noise added to the old log-probs (ratios beyond both clip bounds)."""


def global_batch(vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of the global batch: input tokens, targets, loss mask, per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, vocab, (n + 1,), generator=g)
        mask = torch.ones(n)
        mask[: PROMPT - 1] = 0
        adv = torch.randn((), generator=g) + 0.1 * torch.randn(n, generator=g)
        noise = OLD_NOISE * torch.randn(n, generator=g)
        out.append({"tokens": ids[:-1], "targets": ids[1:], "loss_mask": mask,
                    "advantages": adv, "noise": noise})  # fmt: skip
    return out


def forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens = inputs["tokens"][None]
    positions = torch.arange(tokens.shape[1])[None]
    if not SPEC[0] == "exact":
        return model(tokens, positions, None)
    n = tokens.shape[1]
    cu = torch.tensor([0, n], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                          max_seqlen_kv=n)  # fmt: skip
    return model(tokens, positions, None, packed_seq_params=psp)


def logprobs_of(output: torch.Tensor, inputs: dict[str, torch.Tensor], temperature: float):
    logits = gather_from_tensor_model_parallel_region(output)[0]
    return K.token_logprobs(logits, inputs["targets"], temperature)


def _logprob_step(data_iterator, model):
    inputs = next(data_iterator)
    return forward(model, inputs), lambda out, non_loss_data=False: logprobs_of(out, inputs, 1.0)


def old_logprobs(chunks, seqs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Forward-only log-probs at the current weights (last stage), plus the seeded noise."""
    for c in chunks:
        c.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=_logprob_step, data_iterator=iter(seqs), model=list(chunks),
            num_microbatches=len(seqs), seq_length=max(LENGTHS), micro_batch_size=1,
            forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    return [lp + s["noise"] for lp, s in zip(out, seqs, strict=True)]


def one_run(args, layout: ParallelLayout, cfg: Qwen3MoeConfig, hf: dict, dtype_name: str,
            seed: int) -> dict:  # fmt: skip
    dtype = DTYPES[dtype_name]
    model_parallel_cuda_manual_seed(1234)
    model = build_gpt_model(cfg, layout, dtype, spec=args.spec)
    rank = dist.get_rank()
    model.load_state_dict(hf_to_megatron(cfg, hf, layout, rank, dtype), strict=True)
    settings = OptimizerSettings(lr=args.lr, distributed_optimizer=args.distopt, clip_grad=1.0)
    chunks, optimizer = setup_training(model, settings)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    seqs = global_batch(cfg.vocab_size, seed)[dp_rank::dp]
    olds = old_logprobs(chunks, seqs)
    mbs = [PolicyMicroBatch(inputs=s, old_logprobs=o, advantages=s["advantages"].expand_as(o),
                            loss_mask=s["loss_mask"])
           for s, o in zip(seqs, olds, strict=True)]  # fmt: skip
    record: dict = {"coords": layout.coords(rank), "dtype": dtype_name, "seed": seed,
                    "loss_config": asdict(LOSS),
                    "microbatches": [{"tokens": s["tokens"], "targets": s["targets"],
                                      "loss_mask": s["loss_mask"], "advantages": m.advantages,
                                      "old_logprobs": m.old_logprobs}
                                     for s, m in zip(seqs, mbs, strict=True)]}  # fmt: skip
    kw = {"forward": forward, "logprobs_of": logprobs_of, "loss": LOSS}
    if args.mode == "grad":
        for c in chunks:
            c.train()
        sums = forward_backward(chunks, mbs, **kw)
        record["sums"] = {k: float(v) for k, v in sums.items()}
        record["grads"] = {n: p.main_grad.detach().clone()
                           for n, p in model.named_parameters()}  # fmt: skip
    else:
        steps = [train_step(chunks, optimizer, mbs, **kw) for _ in range(args.steps)]
        record["steps"] = [{"loss": s.loss, "grad_norm": s.grad_norm, "num_tokens": s.num_tokens,
                            **s.metrics} for s in steps]  # fmt: skip
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


SPEC = ["exact"]


def main(args: argparse.Namespace) -> None:
    SPEC[0] = args.spec
    dist.init_process_group("gloo")
    layout = ParallelLayout(world=dist.get_world_size(), tp=args.tp, ep=args.ep, sp=args.sp)
    initialize_parallel_state(layout)
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    hf = load_hf_state_dict(args.ckpt)
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
    ap.add_argument("--spec", choices=["exact", "local"], default="exact")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    main(ap.parse_args())
