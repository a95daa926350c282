"""The trainer side of `onpolicy parity`: Megatron scores rollouts' sequences (torchrun).

`python -m torch.distributed.run --nproc-per-node=W -m onpolicy.parity.trainer_worker
--ckpt DIR --score SAMPLES OUT [--score SAMPLES OUT ...] --tp .. --pp .. --ep .. --etp .. [--sp]
[--stock]`. Every rank builds its shard of the model at that layout from the HF checkpoint once,
then scores prompt + completion of every sample of each SAMPLES file: the exact spec through
`onpolicy.train.logprobs.logprobs` (packed THD micro-batches, each DP replica its share), or with
`--stock` Megatron's local spec (one sequence per micro-batch, log_softmax of the gathered
logits; the negative control). Global rank 0 writes OUT/scores.pt for each: {sample index: fp32
log-probs of tokens 1..len-1} (and with `--row-digests` OUT/digests.pt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from onpolicy.layout import ParallelLayout


def score(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps

    from onpolicy.train.builder import init_parallel, load_model, set_seed
    from onpolicy.train.logprobs import logprobs

    layout = ParallelLayout.from_args(args)
    init_parallel(layout, device=args.device)
    set_seed()
    spec = "local" if args.stock else "exact"
    _cfg, model = load_model(args.ckpt, layout, getattr(torch, args.dtype), spec=spec,
                             device=args.device)  # fmt: skip
    model.eval()

    for samples_file, out in args.score:
        samples = json.loads(Path(samples_file).read_text())["samples"]
        seqs = [s["prompt"] + s["output_ids"] for s in samples]
        digests = None
        if args.stock:
            found = stock_logprobs(model, seqs, args.temperature)
            if found is not None:
                values = [v for v, _ in found]
                digests = [d for _, d in found] if args.row_digests else None
        elif args.row_digests:
            values, digests = logprobs(model, seqs, args.temperature, digests=True) or (None, None)
        else:
            values = logprobs(model, seqs, args.temperature)
        if dist.get_rank() == 0:
            torch.save(dict(enumerate(values)), Path(out) / "scores.pt")
            if digests is not None:
                torch.save(dict(enumerate(digests)), Path(out) / "digests.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def stock_logprobs(model, seqs: list[list[int]], temperature: float) -> list | None:
    """The local spec's log-probs, one sequence per micro-batch (its attention cannot run THD),
    DP replica d taking sequences i % DP == d; on global rank 0 per sequence (log-probs,
    `bits.row_digests` of torch's log_softmax rows), None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from onpolicy.bits import row_digests

    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    mine = [i for i in range(len(seqs)) if i % dp == ps.get_data_parallel_rank()]
    # Under SP the sequence is split over TP: pad at the end (causal: no earlier row changes).
    device = next(model.parameters()).device
    padded = [torch.tensor(seqs[i] + [0] * (-len(seqs[i]) % tp), device=device)[None]
              for i in mine]  # fmt: skip

    def step(data_iterator, chunk):
        tokens = next(data_iterator)

        def logp(out, non_loss_data=True):
            logits = gather_from_tensor_model_parallel_region(out)[0].float()
            return torch.log_softmax(logits / temperature, dim=-1)

        positions = torch.arange(tokens.shape[1], device=device)[None]
        return chunk(tokens, positions, None), logp

    with torch.no_grad():
        outs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(padded), model=[model],
            num_microbatches=len(mine), seq_length=max(p.shape[1] for p in padded),
            micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    found = {}
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        for i, lp in zip(mine, outs, strict=True):
            s = torch.tensor(seqs[i], device=lp.device)
            picked = lp[torch.arange(len(s) - 1, device=lp.device), s[1:]].cpu().contiguous()
            found[i] = (picked, row_digests(lp[: len(s) - 1].contiguous()).cpu())
    parts = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(found, parts, dst=0)
    if parts is None:
        return None
    merged = {i: v for part in parts for i, v in part.items()}
    return [merged[i] for i in range(len(seqs))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="onpolicy.parity.trainer_worker", description=__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--score", nargs=2, action="append", required=True,
                    metavar=("SAMPLES", "OUT"),
                    help="a rollout's JSON (onpolicy.parity.rollout_worker) and the folder of "
                    "its scores; repeated, the model is built once")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ParallelLayout.add_arguments(ap)
    ap.add_argument("--stock", action="store_true", help="Megatron's local spec, not the exact")
    ap.add_argument("--row-digests", action="store_true",
                    help="also digests.pt: whole-row digests")  # fmt: skip
    score(ap.parse_args(argv))


if __name__ == "__main__":
    main()
