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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--jobs", required=True, help="JSON file: [{tokens, out_dir}]")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from onpolicy.checkpoint.hf_megatron import hf_to_megatron
    from onpolicy.layout import ParallelLayout
    from onpolicy.models.hf_layout import load_hf_state_dict
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.train.capture import capture_logprobs
    from onpolicy.train.megatron_model import build_gpt_model, initialize_parallel_state

    dist.init_process_group("gloo")
    layout = ParallelLayout(world=dist.get_world_size(), tp=args.tp, pp=args.pp, ep=args.ep,
                            etp=args.etp, sp=args.sp)  # fmt: skip
    initialize_parallel_state(layout)
    model_parallel_cuda_manual_seed(1234)
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    model = build_gpt_model(cfg, layout, torch.bfloat16, spec="exact")
    hf = load_hf_state_dict(args.ckpt)
    model.load_state_dict(hf_to_megatron(cfg, hf, layout, dist.get_rank(), torch.bfloat16),
                          strict=True)  # fmt: skip
    for job in json.loads(Path(args.jobs).read_text()):
        capture_logprobs(model, job["tokens"], args.temperature, job["out_dir"])
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
