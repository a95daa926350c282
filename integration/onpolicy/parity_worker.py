"""The trainer side of `onpolicy parity`: Megatron scores the rollout's sequences (torchrun).

`python -m torch.distributed.run --nproc-per-node=W -m onpolicy.parity_worker --ckpt DIR
--samples FILE --out DIR --tp .. --pp .. --ep .. --etp .. [--sp]`. Every rank builds its shard of
the model at that layout from the HF checkpoint; DP rank d scores the samples i with
i % DP == d, so each DP rank sees another batch; the last pipeline stage's TP rank 0 writes
`scores-rank{g}.pt`: {sample index: fp32 log-probs of tokens 1..len-1}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def score(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from onpolicy.checkpoint.hf_megatron import hf_to_megatron
    from onpolicy.layout import ParallelLayout
    from onpolicy.models.hf_layout import load_hf_state_dict
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.train.megatron_model import build_gpt_model, initialize_parallel_state

    dist.init_process_group("gloo")
    layout = ParallelLayout(world=dist.get_world_size(), tp=args.tp, pp=args.pp, ep=args.ep,
                            etp=args.etp, sp=args.sp)  # fmt: skip
    initialize_parallel_state(layout)
    model_parallel_cuda_manual_seed(1234)
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    dtype = getattr(torch, args.dtype)
    model = build_gpt_model(cfg, layout, dtype)
    sd = hf_to_megatron(cfg, load_hf_state_dict(args.ckpt), layout, dist.get_rank(), dtype)
    model.load_state_dict(sd, strict=True)
    model.eval()

    samples = json.loads(Path(args.samples).read_text())["samples"]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [i for i in range(len(samples)) if i % dp == dp_rank]
    seqs = [torch.tensor(samples[i]["prompt"] + samples[i]["output_ids"]) for i in mine]
    lps = sequence_logprobs(model, seqs, args.temperature, layout)
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        out = Path(args.out) / f"scores-rank{dist.get_rank()}.pt"
        torch.save(dict(zip(mine, lps, strict=True)), out)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def sequence_logprobs(model, seqs: list[torch.Tensor], temperature: float, layout) -> list:
    """fp32 log p(token i | tokens < i), i = 1..len-1, per sequence, through forward_only."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    # Under SP the sequence is split over TP: pad at the end (causal, so no earlier row changes).
    pad = lambda s: torch.cat([s, s.new_zeros(-len(s) % layout.tp)])  # noqa: E731
    batches = iter([pad(s)[None] for s in seqs])

    def step(data_iterator, model):
        tokens = next(data_iterator)
        pos = torch.arange(tokens.shape[1])[None]

        def logprobs(out, non_loss_data=False):
            logits = gather_from_tensor_model_parallel_region(out)[0].float()
            return torch.log_softmax(logits / temperature, dim=-1)

        return model(tokens, pos, None), logprobs

    with torch.no_grad():
        outs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=batches, model=[model],
            num_microbatches=len(seqs), seq_length=max(len(pad(s)) for s in seqs),
            micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    if not outs:  # not the last pipeline stage
        return []
    return [
        lp[torch.arange(len(s) - 1), s[1:]].contiguous() for lp, s in zip(outs, seqs, strict=True)
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="onpolicy.parity_worker", description=__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--samples", required=True, help="the rollout's JSON (onpolicy.parity_rollout)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    score(ap.parse_args(argv))


if __name__ == "__main__":
    main()
