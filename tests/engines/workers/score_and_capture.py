"""One torchrun job for the routing and `--bisect` checks: the exact Megatron model scores given
sequences with their routed experts, then captures `--bisect`'s points on others.

Every rank loads its shard of the HF checkpoint into the exact spec at the layout, calls
`onpolicy.train.logprobs.logprobs(..., routes=True)` on --sequences (global rank 0 saves
{"logprobs": [fp32 per sequence], "routes": [int32 [len, layers, top_k] per sequence]} to --out,
torch.save), then for each (tokens, out_dir) pair in --jobs calls
`onpolicy.train.capture.capture_logprobs`, which writes every rank's rows into out_dir.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from onpolicy.layout import ParallelLayout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--sequences", required=True, help="JSON list of token-id lists")
    ap.add_argument("--jobs", required=True, help="JSON file: [{tokens, out_dir}]")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--mb-tokens", type=int, default=4096)
    ap.add_argument("--out", required=True)
    ParallelLayout.add_arguments(ap)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from onpolicy.train.builder import init_parallel, load_model, set_seed
    from onpolicy.train.capture import capture_logprobs
    from onpolicy.train.logprobs import logprobs

    layout = ParallelLayout.from_args(args)
    init_parallel(layout)
    set_seed()
    _cfg, model = load_model(args.ckpt, layout, torch.bfloat16, spec="exact")
    seqs = json.loads(Path(args.sequences).read_text())
    got = logprobs(model, seqs, args.temperature, micro_batch_tokens=args.mb_tokens, routes=True)
    if dist.get_rank() == 0:
        values, routes = got
        torch.save({"logprobs": values, "routes": routes}, args.out)
    else:
        assert got is None
    for job in json.loads(Path(args.jobs).read_text()):
        capture_logprobs(model, job["tokens"], args.temperature, job["out_dir"])
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
