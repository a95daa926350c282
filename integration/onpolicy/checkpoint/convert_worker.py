"""One local job of `onpolicy convert`: every rank builds the exact model at the job's layout,
fills it (HF shard, or a torch-dist load) and saves or exports it.

Run as `python -m onpolicy.rendezvous --nproc N -- -m onpolicy.checkpoint.convert_worker JOB.json`
(`rendezvous.torchrun`, the project's launcher; the CLI writes the job).
A refused input (CheckpointError, ContractError) is written to JOB_DIR/refused.txt and the rank
exits 2, so the CLI can tell a refusal from a crash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Only the standard library at module level: megatron-core's save starts a spawn Manager that
# re-imports this module as __mp_main__ on every rank, and torch alone takes seconds to import.
# `main` imports the rest.

REFUSED = "refused.txt"
"""Where a rank writes the refusal it exits 2 with, beside the job file."""


def _model(job: dict[str, Any], layout: ParallelLayout, cfg: Qwen3MoeConfig, weights=None):
    set_seed(0)  # init values are overwritten; the tracker must exist
    return build_model(cfg, layout, torch_dist.DTYPES[job["dtype"]], weights=weights)


def hf_to_dist(job: dict[str, Any], layout: ParallelLayout) -> None:
    ckpt = read_hf_checkpoint(job["hf"])
    dtype = torch_dist.DTYPES[job["dtype"]]
    weights = hf_to_megatron(ckpt.config, ckpt.tensors, layout, dist.get_rank(), dtype)
    model = _model(job, layout, ckpt.config, weights)
    torch_dist.save(job["out"], model, iteration=job["iteration"], cfg=ckpt.config,
                    layout=layout, dtype=dtype, source_hf=job["hf"],
                    config_json=ckpt.config_json)  # fmt: skip


def dist_to_hf(job: dict[str, Any], layout: ParallelLayout) -> None:
    _, manifest = torch_dist.read_manifest(job["ckpt"])
    cfg = torch_dist.manifest_config(manifest)
    model = _model(job, layout, cfg)
    torch_dist.load(job["ckpt"], model, cfg=cfg, layout=layout)
    weights = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    config_json = dict(manifest["model_config"])
    # The weights are in the dtype the checkpoint was trained in; config.json says so.
    for key in ("torch_dtype", "dtype"):
        if key in config_json or key == "torch_dtype":
            config_json[key] = manifest["dtype"]
    source = manifest.get("source_hf")
    source = source if source and Path(source).is_dir() else None
    write_hf_checkpoint(job["out"], config_json, megatron_to_hf(cfg, weights), source=source)


def reshard(job: dict[str, Any], layout: ParallelLayout) -> None:
    from onpolicy.train.step import OptimizerSettings, setup_training

    _, manifest = torch_dist.read_manifest(job["ckpt"])
    cfg = torch_dist.manifest_config(manifest)
    model = _model(job, layout, cfg)
    optimizer = None
    if job["with_optimizer"]:
        saved = manifest["optimizer"]
        settings = OptimizerSettings(
            **saved["settings"], distributed_optimizer=saved["distributed"]
        )
        chunks, optimizer = setup_training(model, settings)
        model = chunks
    torch_dist.load(job["ckpt"], model, optimizer=optimizer, cfg=cfg, layout=layout)
    torch_dist.save(job["out"], model, optimizer=optimizer, iteration=job["iteration"], cfg=cfg,
                    layout=layout, dtype=torch_dist.DTYPES[manifest["dtype"]],
                    source_hf=manifest.get("source_hf"),
                    config_json=manifest["model_config"])  # fmt: skip


MODES = {"hf-to-dist": hf_to_dist, "dist-to-hf": dist_to_hf, "reshard": reshard}


def _import() -> None:
    global torch, dist, torch_dist, CheckpointError, read_hf_checkpoint, write_hf_checkpoint
    global hf_to_megatron, megatron_to_hf, ContractError, ParallelLayout, Qwen3MoeConfig
    global build_model, init_parallel, set_seed
    import torch
    import torch.distributed as dist

    from onpolicy.checkpoint import torch_dist
    from onpolicy.checkpoint.hf import write_hf_checkpoint
    from onpolicy.contract.errors import ContractError
    from onpolicy.layout import ParallelLayout
    from onpolicy.models.hf_layout import CheckpointError, read_hf_checkpoint
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.train.builder import build_model, init_parallel, set_seed
    from onpolicy.train.hf_megatron import hf_to_megatron, megatron_to_hf


def main(job_file: str) -> int:
    _import()
    job = json.loads(Path(job_file).read_text())
    layout = ParallelLayout(**job["layout"])
    init_parallel(layout)
    try:
        MODES[job["mode"]](job, layout)
    except (CheckpointError, ContractError) as e:
        (Path(job_file).parent / REFUSED).write_text(f"{e}\n")
        print(f"onpolicy convert: {e}", file=sys.stderr, flush=True)
        return 2
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
