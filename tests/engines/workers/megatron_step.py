"""One torchrun job on the patched megatron-core: build, load HF weights, forward, train.

Per rank it checks that DP replicas initialise identically (the seeded CPU RNG tracker), loads
the tiny HF checkpoint into its shard, runs a forward-only pass whose gathered logits the last
stage writes out, then wraps the model in Megatron DDP + optimizer and takes optimizer steps
through the real schedules (`get_forward_backward_func`). Results go to --out as torch files.
"""

from __future__ import annotations

import argparse
import hashlib
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.builder import build_model, init_parallel, set_seed
from onpolicy.train.hf_megatron import hf_to_megatron

MICRO_BATCHES, MICRO_BATCH, SEQ = 2, 2, 16


def batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(0, vocab, (MICRO_BATCH, SEQ + 1), generator=g) for _ in range(MICRO_BATCHES)
    ]


def params_digest(model: torch.nn.Module, expert: bool) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if ("experts" in name) == expert:
            h.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def assert_replicas_identical(model: torch.nn.Module) -> None:
    """Non-expert params must match over DP, expert params over expert-DP."""
    for expert, group in ((False, ps.get_data_parallel_group()),
                          (True, ps.get_expert_data_parallel_group())):  # fmt: skip
        digest = params_digest(model, expert)
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, digest, group=group)
        if len(set(seen)) != 1:
            raise AssertionError(f"DP replicas differ at init (expert={expert}): {seen}")


def forward_step(data_iterator, model, with_labels: bool):
    batch = next(data_iterator)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    position_ids = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand_as(tokens)
    if with_labels:
        loss = model(tokens, position_ids, None, labels=labels)

        def loss_func(out):
            total = out.float().sum()
            return total / out.numel(), {"lm loss": total.detach() / out.numel()}

        return loss, loss_func
    logits = model(tokens, position_ids, None)

    def gather(out, non_loss_data=False):
        return gather_from_tensor_model_parallel_region(out)

    return logits, gather


def run(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    layout = ParallelLayout.from_args(args)
    init_parallel(layout, device=args.device)
    set_seed()
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    model = build_model(cfg, layout, spec="local")  # no weights yet: the seeded init is checked
    assert_replicas_identical(model)

    weights = hf_to_megatron(cfg, read_hf_checkpoint(args.ckpt, strict=False).tensors, layout,
                             dist.get_rank(), torch.float32)  # fmt: skip
    model.load_state_dict(weights, strict=True)
    data = batches(cfg.vocab_size)
    if cuda:
        model.cuda()
        data = [b.cuda() for b in data]
    out = Path(args.out)
    last_stage = ps.is_pipeline_last_stage()
    writer = (
        last_stage and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    )

    fb = get_forward_backward_func()
    model.eval()
    with torch.no_grad():
        logits = fb(forward_step_func=partial(forward_step, with_labels=False),
                    data_iterator=iter(data), model=[model], num_microbatches=MICRO_BATCHES,
                    seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=True,
                    collect_non_loss_data=True)  # fmt: skip
    if writer:
        result = {"tokens": torch.stack(data), "logits": torch.stack(logits)}
        torch.save({k: v.cpu() for k, v in result.items()}, out / "logits.pt")

    model.train()
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=args.distopt),
        module=model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                        use_distributed_optimizer=args.distopt),
        [ddp],
    )  # fmt: skip
    losses, norms = [], []
    for _ in range(args.steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        res = fb(forward_step_func=partial(forward_step, with_labels=True),
                 data_iterator=iter(data), model=[ddp], num_microbatches=MICRO_BATCHES,
                 seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)  # fmt: skip
        ok, grad_norm, _ = opt.step()
        if not ok:
            raise AssertionError("optimizer step was skipped")
        if last_stage:
            losses.append(torch.stack([r["lm loss"] for r in res]).mean().item())
        norms.append(float(grad_norm))
    if writer:
        torch.save({"losses": losses, "grad_norms": norms}, out / "train.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ParallelLayout.add_arguments(ap)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    run(ap.parse_args())
