"""`onpolicy convert`: HF <-> Megatron torch-dist checkpoints, and resharding between layouts.

- `hf-to-dist --hf DIR --config RUN.toml [--set K=V] --out ROOT [--iteration N]`: the run's
  training layout loads each rank's shard of the HF weights and saves a model-only checkpoint.
- `dist-to-hf --ckpt ROOT_OR_ITER --out DIR`: loads at world 1 (every saved layout reshards to
  it) and writes the HF folder, with the tokenizer files of the recorded source HF folder.
- `reshard --ckpt ROOT_OR_ITER --config RUN.toml [--set K=V] --out ROOT2 [--model-only]`: loads
  at the run's layout (with the optimizer state when saved, unless --model-only) and saves.

Each runs one local job (`rendezvous.torchrun`, gloo, CPU) of
`onpolicy.checkpoint.convert_worker`. What can be checked before the launch is: config, paths,
the model against the checkpoint, the layout against the model. Exit codes: 0 done, 2 refused
input (the rule on stderr), 3 a worker died. Outputs are atomic, so a failed job leaves nothing
at --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from onpolicy.checkpoint import torch_dist
from onpolicy.contract.errors import ContractError
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import CheckpointError
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.rendezvous import run_group, torchrun

WORKER = "onpolicy.checkpoint.convert_worker"
LOG_TAIL = 4000
"""Characters of a dead job's log printed on stderr."""


class WorkerDied(RuntimeError):
    """The torchrun job failed without a refusal."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="onpolicy convert",
        description="Convert Qwen3-MoE checkpoints between the HF layout and Megatron torch-dist "
        "(atomic: a failed run leaves nothing at --out). Exit 0 done, 2 refused input, 3 a "
        "worker died.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def run_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="TOML run config: its [training] "
                       "layout and model.dtype are used")  # fmt: skip
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key (TOML value), e.g. --set training.tp=2",
        )

    p = sub.add_parser("hf-to-dist", help="HF folder -> torch-dist checkpoint at the run's layout",
                       description="Shard an HF checkpoint at the run config's training layout "
                       "and save it as iteration N of a torch-dist root (model only).")  # fmt: skip
    p.add_argument("--hf", required=True, help="HF checkpoint folder (config.json, *.safetensors)")
    run_config(p)
    p.add_argument("--out", required=True, help="checkpoint root to save into")
    p.add_argument("--iteration", type=int, default=0, help="iteration number (default 0)")

    p = sub.add_parser("dist-to-hf", help="torch-dist checkpoint -> HF folder",
                       description="Load a torch-dist checkpoint at world 1 and write it as an "
                       "HF checkpoint folder, with the source HF folder's tokenizer files "
                       "when that folder still exists.")  # fmt: skip
    p.add_argument("--ckpt", required=True, help="checkpoint root (its `latest`) or an iter_N")
    p.add_argument("--out", required=True, help="HF folder to write (must not exist)")

    p = sub.add_parser("reshard", help="torch-dist checkpoint -> another layout",
                       description="Load a torch-dist checkpoint at the run config's training "
                       "layout and save it there, the optimizer state included when it was "
                       "saved (unless --model-only).")  # fmt: skip
    p.add_argument("--ckpt", required=True, help="checkpoint root (its `latest`) or an iter_N")
    run_config(p)
    p.add_argument("--out", required=True, help="checkpoint root to save into")
    p.add_argument("--iteration", type=int, default=None,
                   help="iteration number (default: the loaded one)")  # fmt: skip
    p.add_argument("--model-only", action="store_true", help="leave the optimizer state behind")
    return ap


def _run_config(args: argparse.Namespace):
    from onpolicy.contract import load_config, parse_override

    cfg = load_config(args.config, dict(parse_override(item) for item in args.set))
    if cfg.device != "cpu":
        raise ContractError("convert_device", f"device = {cfg.device!r}: conversion runs its "
                            "ranks on CPU (gloo)", "pass --set device=cpu")  # fmt: skip
    return cfg


def _same_model(a: Qwen3MoeConfig, b: Qwen3MoeConfig, where_a: str, where_b: str) -> None:
    for f in fields(Qwen3MoeConfig):
        if f.name in torch_dist.MODEL_FIELDS_IGNORED:
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va != vb:
            raise torch_dist.refuse(
                "model_config", where_a,
                f"{f.name} = {va!r}, but {where_b} has {f.name} = {vb!r}",
                "convert into a run config of the same model (its [model] table)",
            )  # fmt: skip


def _refuse_existing_iteration(root: str, iteration: int) -> None:
    it_dir = torch_dist.iteration_dir(Path(root).resolve(), iteration)
    if it_dir.exists():
        raise torch_dist.refuse(
            "iteration_exists",
            it_dir,
            "already exists; a saved iteration is never overwritten",
            "pass another --iteration or --out",
        )


def launch(job: dict, world: int, log=print, timeout_s: float = 7200.0) -> None:
    """Run the worker as a local job of `world` ranks (`rendezvous.torchrun`); raise the
    worker's refusal, or WorkerDied (also when it gives no result within `timeout_s`)."""
    with tempfile.TemporaryDirectory(prefix="onpolicy-convert-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job, indent=2))
        cmd = torchrun(world, "-m", WORKER, str(job_file))
        log(f"onpolicy convert: {job['mode']} on {world} rank(s)")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            p = run_group(cmd, env=env, timeout=timeout_s, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)  # fmt: skip
        except subprocess.TimeoutExpired as e:
            tail = (e.output + e.stderr)[-LOG_TAIL:]
            raise WorkerDied(f"{WORKER} x{world} gave no result within {timeout_s:.0f} s (killed "
                             f"with its ranks):\n{tail}") from None  # fmt: skip
        out, err = p.stdout, p.stderr
        refused = job_file.parent / "refused.txt"
        if refused.is_file():
            raise CheckpointError("convert_refused", job.get("ckpt") or job.get("hf") or "",
                                  refused.read_text().strip())  # fmt: skip
        if p.returncode != 0:
            tail = (out + err)[-LOG_TAIL:]
            raise WorkerDied(f"{WORKER} x{world} exited {p.returncode}:\n{tail}")


def _layout_json(layout: ParallelLayout) -> dict:
    return torch_dist.layout_dict(layout)


def hf_to_dist(args: argparse.Namespace) -> None:
    cfg = _run_config(args)
    hf = Path(args.hf).resolve()
    if not (hf / "config.json").is_file():
        raise CheckpointError("hf_not_checkpoint", hf, "not an HF checkpoint: no config.json")
    try:
        hf_cfg = Qwen3MoeConfig.from_hf(hf)
    except ValueError as e:
        raise CheckpointError("hf_config", hf / "config.json", str(e)) from None
    _same_model(hf_cfg, cfg.shape, str(hf / "config.json"), f"the run config {args.config}")
    torch_dist.check_layout(hf_cfg, cfg.training, args.config)
    if isinstance(args.iteration, bool) or args.iteration < 0:
        raise torch_dist.refuse("iteration", args.out, f"--iteration {args.iteration}",
                                "pass a non-negative integer")  # fmt: skip
    _refuse_existing_iteration(args.out, args.iteration)
    job = {"mode": "hf-to-dist", "hf": str(hf), "out": str(Path(args.out).resolve()),
           "iteration": args.iteration, "layout": _layout_json(cfg.training),
           "dtype": cfg.model.dtype}  # fmt: skip
    launch(job, cfg.training.world)


def dist_to_hf(args: argparse.Namespace) -> None:
    it_dir, manifest = torch_dist.read_manifest(args.ckpt)
    torch_dist.verify(it_dir, manifest)  # refused here, before a worker starts
    torch_dist.manifest_config(manifest)
    out = Path(args.out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError("hf_out_exists", out, "exists and is not empty; not overwritten")
    job = {"mode": "dist-to-hf", "ckpt": str(it_dir), "out": str(out),
           "layout": _layout_json(ParallelLayout(world=1)), "dtype": manifest["dtype"]}  # fmt: skip
    launch(job, 1)


def reshard(args: argparse.Namespace) -> None:
    cfg = _run_config(args)
    it_dir, manifest = torch_dist.read_manifest(args.ckpt)
    torch_dist.verify(it_dir, manifest)  # refused here, before a worker starts
    layout = cfg.training
    with_optimizer = bool(manifest.get("has_optimizer")) and not args.model_only
    opt = None
    if with_optimizer:
        opt = {"sub_optimizers": 2 if torch_dist.expert_sub_optimizer(layout) else 1,
               "distributed": manifest["optimizer"]["distributed"]}  # fmt: skip
    dtype = torch_dist.DTYPES.get(cfg.model.dtype)
    if dtype is None:
        raise ContractError("dtype", f"model.dtype = {cfg.model.dtype!r}",
                            f"use one of {list(torch_dist.DTYPES)}")  # fmt: skip
    try:
        torch_dist.check_compatible(it_dir, manifest, cfg.shape, layout, dtype, optimizer=opt)
    except CheckpointError as e:
        if e.rule != "optimizer_layout":
            raise
        raise CheckpointError(e.rule, e.file, f"{e.detail} (or pass --model-only)") from None
    iteration = manifest["iteration"] if args.iteration is None else args.iteration
    _refuse_existing_iteration(args.out, iteration)
    job = {"mode": "reshard", "ckpt": str(it_dir), "out": str(Path(args.out).resolve()),
           "iteration": iteration, "layout": _layout_json(layout), "dtype": manifest["dtype"],
           "with_optimizer": with_optimizer}  # fmt: skip
    launch(job, layout.world)


COMMANDS = {"hf-to-dist": hf_to_dist, "dist-to-hf": dist_to_hf, "reshard": reshard}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (CheckpointError, ContractError) as e:
        print(f"onpolicy convert {args.command}: {e}", file=sys.stderr)
        return 2
    except WorkerDied as e:
        print(f"onpolicy convert {args.command}: {e}", file=sys.stderr)
        return 3
    print(f"onpolicy convert {args.command}: wrote {Path(args.out).resolve()}")
    return 0
