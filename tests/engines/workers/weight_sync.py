"""One trainer layout (torchrun, gloo) syncing its weights into running SGLang engines, checked.

Every rank builds the exact model at the layout from the trainer's checkpoint (not the one the
engines started from), then, collectively:
1. `verify` before any sync: the engines hold other weights, so the check must name mismatches
   (the check's negative control);
2. `sync` (version v1) in buckets over the transport, then `verify`: every box equal;
3. each engine samples; the trainer scores the same tokens with `onpolicy.train.logprobs`;
   the log-probs must be bitwise equal;
4. one tensor is changed on engine 0 behind the trainer's back (a real update_weights_from_tensor
   session); `verify` must name that tensor and that engine;
5. `sync` again (version v2, the same group) and `verify`: clean again.
Rank 0 writes everything to --out as JSON; assertions live in the test.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from onpolicy.layout import ParallelLayout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="the trainer's HF checkpoint")
    ap.add_argument("--engines", required=True, help="JSON [{name, address_file}]")
    ParallelLayout.add_arguments(ap)
    ap.add_argument("--transport", default="distributed")
    ap.add_argument("--bucket-bytes", type=int, default=1 << 16)
    ap.add_argument("--prompts", default="[[1, 2, 3, 4], [10, 20, 30], [500, 600, 700, 800, 900]]")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from onpolicy.bits import as_bits
    from onpolicy.models.hf_layout import read_hf_checkpoint
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.rollout.host import KEY_ENV, EngineClient
    from onpolicy.train.builder import build_model, init_parallel, set_seed
    from onpolicy.train.hf_megatron import hf_to_megatron
    from onpolicy.train.logprobs import logprobs
    from onpolicy.weights import Gatherer, SyncConfig, WeightSync, WeightSyncError

    layout = ParallelLayout.from_args(args)
    init_parallel(layout)
    rank = dist.get_rank()
    set_seed()
    cfg = Qwen3MoeConfig.from_hf(args.ckpt)
    hf = read_hf_checkpoint(args.ckpt, strict=False).tensors  # also the tampered weight's source
    weights = hf_to_megatron(cfg, hf, layout, rank, torch.bfloat16)
    model = build_model(cfg, layout, torch.bfloat16, spec="exact", weights=weights).eval()

    engines = []
    if rank == 0:
        key = os.environ[KEY_ENV]
        engines = [EngineClient.connect(e["name"], e["address_file"], key)
                   for e in json.loads(args.engines)]  # fmt: skip
    config = SyncConfig(transport=args.transport, bucket_bytes=args.bucket_bytes)
    sync = WeightSync(Gatherer(model, cfg, layout), engines, config)
    result: dict = {"layout": layout.degrees(), "transport": args.transport}

    def check(what: str) -> None:
        try:
            rep = sync.verify()
            if rank == 0:
                result[what] = {"ok": True, "tensors": rep.tensors, "boxes": rep.boxes}
        except WeightSyncError as e:  # raised on rank 0 only, after the collective walk
            result[what] = {"ok": False, "message": str(e)}

    request = {"prompts": json.loads(args.prompts), "new_tokens": args.new_tokens,
               "temperature": args.temperature}  # fmt: skip

    def rollouts(clients) -> list[dict]:
        """Each engine samples; the trainer scores the same tokens; equal bits counted."""
        box = [[[e.name, e.call("generate", request=request)] for e in clients]]
        dist.broadcast_object_list(box, src=0)
        found = []
        for name, ss in box[0]:
            scores = logprobs(model, [s["prompt"] + s["output_ids"] for s in ss], args.temperature)
            if rank == 0:
                equal = compared = 0
                for s, lp in zip(ss, scores, strict=True):
                    mine = lp[len(s["prompt"]) - 1 :]
                    theirs = torch.tensor(s["logprobs"], dtype=torch.float32)
                    compared += len(theirs)
                    equal += int((as_bits(mine) == as_bits(theirs)).sum())
                found.append({"engine": name, "equal": equal, "compared": compared,
                              "versions": sorted({s["weight_version"] for s in ss})})  # fmt: skip
        return found

    # Controls: before the sync the engines hold other weights than the trainer.
    result["rollouts_before"] = rollouts(engines[:1])
    check("before")
    stats = sync.sync("v1")
    if rank == 0:
        result["sync"] = {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets,
                          "seconds": stats.seconds}  # fmt: skip
    check("after")
    result["rollouts"] = rollouts(engines)

    # Behind the trainer's back: engine 0's copy of one expert's down projection changes.
    victim = f"model.layers.{cfg.num_hidden_layers - 1}.mlp.experts.{cfg.num_experts - 1}."
    victim += "down_proj.weight"
    if rank == 0:
        from sglang.srt.utils import MultiprocessingSerializer

        e = engines[0]
        e.call("begin_weight_update")
        t = (hf[victim] * 2).contiguous()
        e.call("update_weights_from_tensor", serialized_named_tensors=[
            MultiprocessingSerializer.serialize([(victim, t)]) for _ in range(e.tp)])  # fmt: skip
        e.call("end_weight_update")
        result["victim"] = {"engine": e.name, "tensor": victim}
    check("tampered")
    stats = sync.sync("v2")
    check("resynced")
    if rank == 0:
        result["resync"] = {"tensors": stats.tensors, "buckets": stats.buckets}
        sync.close()
        for e in engines:
            e.close()
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
