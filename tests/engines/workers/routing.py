"""One torchrun job: the exact Megatron model scores given sequences with their routed experts.

Every rank loads its shard of the HF checkpoint into the exact spec at the layout and calls
`onpolicy.train.logprobs.logprobs(..., routes=True)`; global rank 0 saves
{"logprobs": [fp32 per sequence], "routes": [int32 [len, layers, top_k] per sequence]} to
--out (torch.save).
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
    ap.add_argument("--sequences", required=True, help="JSON list of token-id lists")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--mb-tokens", type=int, default=4096)
    ap.add_argument("--out", required=True)
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
    from onpolicy.train.logprobs import logprobs
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
    seqs = json.loads(Path(args.sequences).read_text())
    got = logprobs(model, seqs, args.temperature, micro_batch_tokens=args.mb_tokens, routes=True)
    if dist.get_rank() == 0:
        values, routes = got
        torch.save({"logprobs": values, "routes": routes}, args.out)
    else:
        assert got is None
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
