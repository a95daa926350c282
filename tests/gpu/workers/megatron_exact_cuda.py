"""One GPU, world 1 (NCCL): the exact Megatron spec's log-probs on CUDA, the stock spec's (the
control), and one PPO step through Megatron DDP and the distributed optimizer.

Rank 0 writes {"exact": [fp32 per sequence], "stock": [...], "step": StepResult fields,
"after": [fp32 per sequence, at the stepped weights]} to --out/result.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.builder import build_model, init_parallel, set_seed
from onpolicy.train.hf_megatron import hf_to_megatron
from onpolicy.train.logprobs import logprobs, token_logprobs
from onpolicy.train.loss import PPOClipConfig
from onpolicy.train.step import (
    OptimizerSettings,
    policy_micro_batches,
    setup_training,
    train_step,
)


def stock_logprobs(model, seqs: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """The stock local spec's log-probs, one sequence per micro-batch (bshd, b = 1), world 1."""

    def forward_step(data_iterator, chunk):
        seq = torch.tensor(next(data_iterator), device="cuda")
        logits = chunk(seq[None], torch.arange(len(seq), device="cuda")[None], None)

        def collect(out, non_loss_data=True):
            return token_logprobs(out[0, : len(seq) - 1], seq[1:], temperature)

        return logits, collect

    model.eval()
    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(seqs), model=[model],
            num_microbatches=len(seqs), seq_length=max(len(s) for s in seqs),
            micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip


def main(args: argparse.Namespace) -> None:
    layout = ParallelLayout(world=1)
    init_parallel(layout, device="cuda")
    set_seed()
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    hf = read_hf_checkpoint(args.ckpt, strict=False).tensors
    weights = hf_to_megatron(cfg, hf, layout, 0, torch.bfloat16)
    del hf
    seqs = json.loads(Path(args.sequences).read_text())
    t = args.temperature

    stock = build_model(cfg, layout, torch.bfloat16, spec="local", weights=weights, device="cuda")
    control = [x.float().cpu() for x in stock_logprobs(stock, [s for s in seqs if len(s) > 1], t)]
    del stock
    torch.cuda.empty_cache()

    model = build_model(cfg, layout, torch.bfloat16, spec="exact", weights=weights, device="cuda")
    del weights
    exact = [x.cpu() for x in logprobs(model, seqs, t, micro_batch_tokens=args.mb_tokens)]

    # One PPO step from the rollout's log-probs (here the exact ones): at the weights they came
    # from every ratio is exactly 1, so nothing is clipped.
    g = torch.Generator().manual_seed(5)
    advantages = [torch.randn(len(s) - 1, generator=g) if len(s) > 1 else torch.zeros(0)
                  for s in seqs]  # fmt: skip
    masks = [torch.ones(len(s) - 1) for s in seqs]
    chunks, optimizer = setup_training(model, OptimizerSettings(lr=1e-4))
    mbs = policy_micro_batches(seqs, exact, advantages, masks, micro_batch_tokens=args.mb_tokens)
    step = train_step(chunks, optimizer, mbs, loss=PPOClipConfig(), temperature=t)
    after = [x.cpu() for x in logprobs(chunks[0], seqs, t, micro_batch_tokens=args.mb_tokens)]
    torch.save({"exact": exact, "stock": control, "step": dataclasses.asdict(step),
                "after": after, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30},
               Path(args.out) / "result.pt")  # fmt: skip
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--sequences", required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--mb-tokens", type=int, default=4096)
    main(ap.parse_args())
