"""One torchrun job: the exact Megatron model captures `--bisect`'s points on given sequences.

Every rank loads its shard of the HF checkpoint into the exact spec at the layout; for each
(tokens, out_dir) pair in --jobs it calls `onpolicy.train.capture.capture_logprobs`, which
writes every rank's rows into out_dir.
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
    ap.add_argument("--jobs", required=True, help="JSON file: [{tokens, out_dir}]")
    ap.add_argument("--temperature", type=float, default=1.0)
    ParallelLayout.add_arguments(ap)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from onpolicy.train.builder import init_parallel, load_model, set_seed
    from onpolicy.train.capture import capture_logprobs

    layout = ParallelLayout.from_args(args)
    init_parallel(layout)
    set_seed()
    _cfg, model = load_model(args.ckpt, layout, torch.bfloat16, spec="exact")
    for job in json.loads(Path(args.jobs).read_text()):
        capture_logprobs(model, job["tokens"], args.temperature, job["out_dir"])
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
