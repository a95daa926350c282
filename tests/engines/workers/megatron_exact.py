"""One torchrun job: Megatron's per-token log-probs at one layout, exact spec and stock spec.

For bf16 and fp32, it loads the HF checkpoint into this rank's shard of:
- the exact spec (`build_model(spec="exact")`), scored by `onpolicy.train.logprobs.logprobs`
  (packed THD micro-batches through `forward_only`, the vocab-parallel exact log-softmax);
- the stock local spec (the control), one sequence per micro-batch (its core attention cannot
  run THD), through the same schedule; from the same logits it keeps Megatron's own log-probs
  (-vocab_parallel_cross_entropy on the labels) and the exact vocab-parallel log-softmax.
It also checks the gradient of the vocab-parallel log-prob against torch's on random logits.
Global rank 0 writes {dtype: {"exact"|"stock_ce"|"stock_logsoftmax": [per-sequence fp32]},
"grad_error": max abs gradient difference over the ranks}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.builder import build_model, init_parallel, set_seed
from onpolicy.train.hf_megatron import hf_to_megatron
from onpolicy.train.logprobs import logprobs, token_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def stock_logprobs(model, seqs: list[list[int]], temperature: float) -> dict[str, list] | None:
    """The stock spec's two log-prob paths, per sequence (bshd, b = 1), on global rank 0."""
    tp = ps.get_tensor_model_parallel_world_size()

    def forward_step(data_iterator, chunk):
        seq = torch.tensor(next(data_iterator))
        n = len(seq) + (-len(seq) % tp)  # SP splits the sequence over TP; pad at the end
        tokens = torch.zeros(1, n, dtype=torch.long)
        tokens[0, : len(seq)] = seq
        labels = torch.roll(tokens, -1, dims=1)
        logits = chunk(tokens, torch.arange(n)[None], None)

        def collect(out, non_loss_data=True):
            shard = out[0, : len(seq) - 1]
            ce = tensor_parallel.vocab_parallel_cross_entropy(  # modifies fp32 logits in place
                (shard.float() / temperature)[:, None].clone(), labels[0, : len(seq) - 1, None]
            )[:, 0]
            lsm = token_logprobs(shard, labels[0, : len(seq) - 1], temperature)
            return {"stock_ce": -ce, "stock_logsoftmax": lsm}

        return logits, collect

    model.eval()
    with torch.no_grad():
        res = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(seqs), model=[model],
            num_microbatches=len(seqs), seq_length=max(len(s) for s in seqs) + tp,
            micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    mine = res if writer and ps.get_data_parallel_rank() == 0 else []
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, got, dst=0)
    if got is None:
        return None
    rows = next(g for g in got if g)
    return {k: [r[k].cpu() for r in rows] for k in ("stock_ce", "stock_logsoftmax")}


def logprob_grad_error(vocab: int, temperature: float) -> float:
    """max |grad - torch's| of `token_logprobs` w.r.t. this rank's vocab shard of random logits,
    against autograd through torch.log_softmax of the full logits (fp32)."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(37, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (37,), generator=g)
    weights = torch.randn(37, generator=g)
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shard = full.chunk(tp, dim=-1)[r].clone().requires_grad_()
    (token_logprobs(shard, targets, temperature) * weights).sum().backward()
    ref = full.clone().requires_grad_()
    lsm = torch.log_softmax(ref / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    (lsm * weights).sum().backward()
    return float((shard.grad - ref.grad.chunk(tp, dim=-1)[r]).abs().max())


def run(args: argparse.Namespace) -> None:
    layout = ParallelLayout.from_args(args)
    init_parallel(layout)
    set_seed()
    if dist.get_rank() == 0:
        import megatron.core

        print(f"megatron.core from {megatron.core.__file__}", flush=True)
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    hf = read_hf_checkpoint(args.ckpt, strict=False).tensors
    seqs = json.loads(Path(args.sequences).read_text())
    result: dict[str, dict[str, list]] = {}
    for name, dtype in DTYPES.items():
        weights = hf_to_megatron(cfg, hf, layout, dist.get_rank(), dtype)
        exact = build_model(cfg, layout, dtype, spec="exact", weights=weights)
        values = logprobs(exact, seqs, args.temperature, micro_batch_tokens=args.mb_tokens)
        stock = build_model(cfg, layout, dtype, spec="local", weights=weights)
        control = stock_logprobs(stock, seqs, args.temperature)
        if dist.get_rank() == 0:
            result[name] = {"exact": values, **control}
    grad_err = torch.tensor(logprob_grad_error(cfg.vocab_size, args.temperature))
    dist.all_reduce(grad_err, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        result["grad_error"] = float(grad_err)
        torch.save(result, Path(args.out) / "logprobs.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequences", required=True, help="JSON list of token-id lists")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--mb-tokens", type=int, default=64, help="token budget per micro-batch")
    ParallelLayout.add_arguments(ap)
    run(ap.parse_args())
