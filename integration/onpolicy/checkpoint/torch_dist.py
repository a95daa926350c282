"""Megatron torch-dist checkpoints of the trainer: atomic saves, resharding loads, checked inputs.

A checkpoint root holds one folder per saved iteration and a tracker:

    ROOT/iter_0000002/        megatron-core's `dist_checkpointing` (torch_dist) files:
                              __{rank}_{i}.distcp, .metadata, metadata.json
                              + onpolicy-checkpoint.json (MANIFEST): model config, dtype,
                              layout, iteration, optimizer, source HF folder, and the
                              sha256 of every other file
    ROOT/latest               the newest complete iteration, written last

Every rank writes into `ROOT/.iter_{N:07d}.tmp`; only when megatron-core's save has returned
on every rank does rank 0 add the manifest, rename the folder to `iter_{N:07d}` and then
replace `latest`. A writer killed at any point leaves the previous iterations and `latest` as
they were; the next save of N removes the stale `.tmp`. megatron-core's own save writes its
shards in place and overwrites silently, so it is only ever pointed at a fresh folder.

Model weights reshard to any layout that divides the model: the saved tensors are global
(layers stacked, experts by global id), and each rank reads its slice. Optimizer state is
saved `fully_reshardable` (the DistributedOptimizer's canonical, layout-free form), but it
still cannot cross between layouts with a different number of chained sub-optimizers:
megatron-core builds a separate expert optimizer exactly when EP > 1 or ETP != TP.

Reading runs no code from the folder: before torch's reader sees it (`verify`, in `load` and
`global_tensors`, and in `convert` before it launches), every file's sha256 must
be the manifest's, metadata.json must be megatron-core's torch_dist marker, and `.metadata`
(a pickle, which torch's reader loads) must hold only the classes an index of tensors is made
of (`METADATA_CLASSES`); anything else is refused with the rule named.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from onpolicy.fsutil import fsync_path, write_atomic, write_synced
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import CheckpointError
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.megatron_model import unwrap

FORMAT_VERSION = 2
"""Version of the manifest's schema; a checkpoint of another version is refused. 2: the
manifest holds every file's sha256."""
MANIFEST = "onpolicy-checkpoint.json"
"""The onpolicy manifest inside an iteration folder."""
TRACKER = "latest"
"""The file in the root naming the newest complete iteration."""
SHARDING = "fully_reshardable"
"""The DistributedOptimizer's layout-free state format; the only one a layout change can read."""
SHARDED_METADATA = {
    "distrib_optim_sharding_type": SHARDING,
    "singleton_local_shards": False,
    # Optimizer tensors keyed by the model's names, not by sub-optimizer index.
    "chained_optim_avoid_prefix": True,
    # Gather the optimizer state to DP rank 0 over the gloo group, in host memory. Without it
    # megatron-core gathers over NCCL into GPU buffers the size of the whole fp32 state: on an
    # 80 GB GPU beside a colocated engine the one-GPU run's save (11.6 GiB) ran out of memory.
    "distrib_optim_fully_reshardable_mem_efficient": True,
}
"""The `metadata` of every sharded state dict, as Megatron-LM's training loop passes it."""
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
OPTIMIZER_SETTINGS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
"""megatron-core OptimizerConfig fields the manifest records (onpolicy.train.step's names)."""
LAYOUT_KEYS = ("world", "tp", "pp", "ep", "etp", "sp", "cp")
METADATA_CLASSES = {
    "pathlib": {"PosixPath"},  # torch's StorageMeta.checkpoint_id, where a save records it
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"},
}  # fmt: skip
"""What `.metadata` may name (and torch's dtypes): the classes of torch's checkpoint index."""
MODEL_FIELDS_IGNORED = ("torch_dtype",)
"""Config fields that do not change the model: the stored dtype is checked on its own."""


def refuse(rule: str, file: str | os.PathLike, problem: str, fix: str) -> CheckpointError:
    """A CheckpointError naming the file, the rule, the values, and what to do."""
    return CheckpointError(rule, file, f"{problem}; fix: {fix}")


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """The folder of a complete iteration."""
    return Path(root) / f"iter_{iteration:07d}"


def _tmp_dir(root: Path, iteration: int) -> Path:
    return root / f".iter_{iteration:07d}.tmp"


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise refuse("dtype", "", f"dtype {dtype} has no checkpoint name", f"use one of {list(DTYPES)}")


def config_sha256(config_json: dict) -> str:
    """sha256 of the config as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(config_json, sort_keys=True).encode()).hexdigest()


def layout_dict(layout: ParallelLayout) -> dict[str, Any]:
    return {k: getattr(layout, k) for k in LAYOUT_KEYS}


def layout_name(degrees: dict[str, Any]) -> str:
    """A manifest's layout (`layout_dict`) by name, every degree spelled:
    world8-tp2-pp2-ep2-etp1-sp (`ParallelLayout.name(full=True)`)."""
    return ParallelLayout(**degrees).name(full=True)


def expert_sub_optimizer(layout: ParallelLayout | dict[str, Any]) -> bool:
    """Whether megatron-core builds a separate expert optimizer at this layout: expert params
    are not all-reduced with the others when EP > 1 or ETP != TP (tensor_parallel/layers.py)."""
    d = layout_dict(layout) if isinstance(layout, ParallelLayout) else layout
    return d["ep"] > 1 or d["etp"] != d["tp"]


def check_layout(
    cfg: Qwen3MoeConfig, layout: ParallelLayout, where: str | os.PathLike = ""
) -> None:
    """Refuse a layout that does not divide the model or the world, before any rank builds.

    `where` names the checkpoint (or config) the refusal is about."""
    tpc = layout.tp * layout.pp * layout.cp
    if layout.world % tpc:
        raise refuse(
            "layout_divides_world",
            where,
            f"world {layout.world} is not a multiple of tp x pp x cp = {tpc}",
            "make the world a multiple of tp x pp x cp",
        )
    if (layout.tp * layout.cp * layout.dp) % (layout.ep * layout.etp):
        raise refuse(
            "layout_divides_world",
            where,
            f"a stage's tp x cp x dp = {layout.tp * layout.cp * layout.dp} ranks do not split "
            f"into etp x ep = {layout.etp} x {layout.ep} expert groups",
            "choose ep x etp dividing tp x dp",
        )
    shards = [
        ("num_hidden_layers", cfg.num_hidden_layers, "pp", layout.pp),
        ("num_experts", cfg.num_experts, "ep", layout.ep),
        ("num_attention_heads", cfg.num_attention_heads, "tp", layout.tp),
        ("num_key_value_heads", cfg.num_key_value_heads, "tp", layout.tp),
        ("vocab_size", cfg.vocab_size, "tp", layout.tp),
        ("moe_intermediate_size", cfg.moe_intermediate_size, "etp", layout.etp),
    ]
    for field, value, degree, n in shards:
        if value % n:
            raise refuse(
                "layout_divides_model",
                where,
                f"{field} = {value} does not divide over {degree} = {n} "
                f"(layout {layout.name(full=True)})",
                f"choose {degree} dividing {value}",
            )
    if layout.tp > 1 and not layout.sp:
        raise refuse(
            "layout_divides_model",
            where,
            f"tp = {layout.tp} without sequence parallel: megatron-core's MoE layers need SP "
            "when TP > 1",
            "set sp = true",
        )


def single_chunk(model: torch.nn.Module | list | tuple) -> torch.nn.Module:
    """The GPTModel of the one model chunk, under its wrappers (Megatron DDP's own
    sharded_state_dict would prefix `module.`)."""
    if isinstance(model, list | tuple):
        if len(model) != 1:
            raise refuse(
                "single_model_chunk",
                "",
                f"{len(model)} model chunks (virtual pipeline stages)",
                "save and load one chunk per rank",
            )
        model = model[0]
    return unwrap(model)


def _optimizer_info(optimizer: Any) -> dict[str, Any]:
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    config = subs[0].config
    return {
        "sharding_type": SHARDING,
        "sub_optimizers": len(subs),
        "distributed": all(isinstance(s, DistributedOptimizer) for s in subs),
        # A load matches param groups by these values, so a rebuilt optimizer needs them.
        "settings": {k: getattr(config, k) for k in OPTIMIZER_SETTINGS},
    }


def _optimizer_stepped(optimizer: Any) -> bool:
    """Every rank's inner torch optimizers hold state (Adam's moments exist after a step)."""
    from megatron.core.optimizer import ChainedOptimizer

    subs = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    # NCCL reduces only CUDA tensors ("No backend type associated with device type cpu").
    device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    mine = torch.tensor([int(all(len(s.optimizer.state) > 0 for s in subs))], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return bool(mine.item())


def _agree(error: CheckpointError | None) -> None:
    """Rank 0's verdict on every rank: raise the same CheckpointError everywhere, or go on."""
    box = [None if error is None else (error.rule, str(error.file), error.detail, error.tensor)]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(*box[0])


def read_tracker(root: Path) -> int | None:
    """The iteration `latest` names, or None when there is none."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise refuse("tracker", tracker, f"it holds {text!r}, not an iteration number",
                     "write the newest complete iteration's number into it")  # fmt: skip
    return int(text)


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file in an iteration folder but the manifest, by name."""
    out = {}
    for f in sorted(folder.iterdir()):
        if f.name == MANIFEST:
            continue
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


class _IndexUnpickler(pickle.Unpickler):
    """Loads only what `METADATA_CLASSES` names, and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a class of torch's checkpoint index")


def check_metadata(it_dir: Path) -> None:
    """Refuse a `.metadata` that names anything but torch's checkpoint index classes, and a
    metadata.json that is not megatron-core's torch_dist marker (before either is used)."""
    try:
        _IndexUnpickler(io.BytesIO((it_dir / ".metadata").read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any failure to read it as an index is a refusal
        raise refuse("checkpoint_index", it_dir / ".metadata", f"not torch's checkpoint index "
                     f"({type(e).__name__}: {e})", "restore the folder from the writer; never "
                     "load a checkpoint from an untrusted source") from None  # fmt: skip
    try:
        marker = json.loads((it_dir / "metadata.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise refuse("checkpoint_index", it_dir / "metadata.json", f"not valid JSON: {e}",
                     "restore the folder from the writer") from None  # fmt: skip
    backend = marker.get("sharded_backend") if isinstance(marker, dict) else marker
    if backend != "torch_dist":
        raise refuse("checkpoint_index", it_dir / "metadata.json",
                     f"names backend {backend!r}, not torch_dist",
                     "restore the folder from the writer")  # fmt: skip


def set_aside_newer(root: Path) -> list[tuple[Path, Path]]:
    """Rename every `iter_N` newer than `latest` (a save that died between publishing its folder
    and moving `latest`) to `.iter_N.aside-<stamp>`, so a resume can save N again; the
    (old, new) paths. Nothing is deleted."""
    latest = read_tracker(root)
    if latest is None:
        return []
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for d in sorted(root.glob("iter_*")):
        n = d.name.removeprefix("iter_")
        if d.is_dir() and n.isdigit() and int(n) > latest:
            target = root / f".{d.name}.aside-{stamp}"
            os.rename(d, target)
            moved.append((d, target))
    if moved:
        fsync_path(root)
    return moved


def _publish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, after every rank's shards are on disk: manifest, rename, then the tracker."""
    manifest = {**manifest, "files": file_hashes(tmp)}
    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(final.parent)
    write_atomic(final.parent / TRACKER, f"{manifest['iteration']}\n")


def save(
    root: str | os.PathLike,
    model: Any,
    *,
    optimizer: Any = None,
    iteration: int,
    cfg: Qwen3MoeConfig,
    layout: ParallelLayout,
    dtype: torch.dtype,
    source_hf: str | os.PathLike | None = None,
    config_json: dict | None = None,
) -> Path:
    """Save `model` (and `optimizer`) as iteration `iteration` of `root`; every rank calls it.

    `config_json` is the HF config.json to record (default `cfg.to_hf()`, or the source HF
    folder's own when `source_hf` has one). An existing iteration is refused, never
    overwritten. Returns the iteration folder.
    """
    from megatron.core import dist_checkpointing

    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise refuse("iteration", root, f"iteration {iteration!r}", "pass a non-negative integer")
    root = Path(root).resolve()
    if optimizer is not None and not _optimizer_stepped(optimizer):
        raise refuse("optimizer_state", root, "the optimizer has taken no step, so it has no "
                     "state to save", "save the model only (optimizer=None)")  # fmt: skip
    final, tmp = iteration_dir(root, iteration), _tmp_dir(root, iteration)
    error = None
    if dist.get_rank() == 0:
        if final.exists():
            error = refuse(
                "iteration_exists",
                final,
                "already exists; a saved iteration is never overwritten",
                "save another iteration, or into another root",
            )
        else:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a writer killed before the rename
            tmp.mkdir()
    _agree(error)
    gpt = single_chunk(model)
    sd: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=SHARDED_METADATA)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd["model"], is_loading=False, metadata=SHARDED_METADATA
        )
    dist_checkpointing.save(sd, str(tmp))
    error = None
    if dist.get_rank() == 0:
        if config_json is None:
            src = Path(source_hf) / "config.json" if source_hf else None
            config_json = json.loads(src.read_text()) if src and src.is_file() else cfg.to_hf()
        manifest = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "model_config": config_json,
            "config_sha256": config_sha256(config_json),
            "dtype": dtype_name(dtype),
            "layout": layout_dict(layout),
            "has_optimizer": optimizer is not None,
            "optimizer": _optimizer_info(optimizer) if optimizer is not None else None,
            "source_hf": str(Path(source_hf).resolve()) if source_hf else None,
        }
        try:
            _publish(tmp, final, manifest)
        except OSError as e:
            error = CheckpointError("publish", final, f"could not publish the save: {e}")
    _agree(error)
    dist.barrier()
    return final


# --- load ----------------------------------------------------------------------------------------


def resolve(path: str | os.PathLike) -> Path:
    """The iteration folder that `path` names: itself, or its root's `latest`."""
    p = Path(path).resolve()
    if p.name.startswith(".") and p.name.endswith(".tmp"):
        raise refuse(
            "not_a_checkpoint",
            p,
            "is an unfinished save (a .tmp folder is renamed to iter_N only when complete)",
            f"load the root {p.parent} or one of its iter_N folders",
        )
    if not p.is_dir():
        raise refuse("not_a_checkpoint", p, "does not exist", "pass a checkpoint root or iter_N")
    if (p / MANIFEST).is_file():
        return p
    it = read_tracker(p)
    if it is None:
        iters = sorted(q.name for q in p.glob("iter_*") if q.is_dir())
        raise refuse(
            "not_a_checkpoint",
            p,
            f"has neither {MANIFEST} (an iteration folder) nor a `{TRACKER}` file (a root)"
            + (f"; it holds {iters}" if iters else ""),
            "pass a root written by onpolicy.checkpoint.torch_dist.save or one of its iter_N",
        )
    it_dir = iteration_dir(p, it)
    if not (it_dir / MANIFEST).is_file():
        raise refuse("not_a_checkpoint", p / TRACKER, f"names iteration {it}, but {it_dir} "
                     f"has no {MANIFEST}", "pass an existing iter_N folder")  # fmt: skip
    return it_dir


def read_manifest(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(iteration folder, manifest) of a complete checkpoint; refuse anything else."""
    it_dir = resolve(path)
    try:
        manifest = json.loads((it_dir / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise refuse("manifest", it_dir / MANIFEST, f"not valid JSON: {e}",
                     "restore the file from the writer") from e  # fmt: skip
    keys = ("format_version", "iteration", "model_config", "config_sha256", "dtype", "layout",
            "has_optimizer", "optimizer", "source_hf", "files")  # fmt: skip
    missing = [k for k in keys if k not in manifest] if isinstance(manifest, dict) else keys
    if missing:
        raise refuse("manifest", it_dir / MANIFEST, f"lacks {list(missing)}",
                     "restore the file from the writer")  # fmt: skip
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise refuse("manifest", it_dir / MANIFEST,
                     f"format_version {version!r}, this reader knows {FORMAT_VERSION}",
                     "read it with the onpolicy version that wrote it")  # fmt: skip
    for name in ("metadata.json", ".metadata"):
        if not (it_dir / name).is_file():
            raise refuse(
                "not_a_checkpoint",
                it_dir,
                f"has no {name}: megatron-core's save did not complete there",
                "load an earlier iteration (its root's `latest`)",
            )
    config = manifest.get("model_config")
    if not isinstance(config, dict) or config_sha256(config) != manifest.get("config_sha256"):
        raise refuse("manifest", it_dir / MANIFEST, "model_config does not match its "
                     "config_sha256", "restore the file from the writer")  # fmt: skip
    return it_dir, manifest


def verify(it_dir: Path, manifest: dict[str, Any]) -> None:
    """Before torch's reader sees the folder: every file's sha256 is the manifest's, and
    `check_metadata`. Once per load, in one process (it reads every byte)."""
    recorded = manifest["files"]
    found = file_hashes(it_dir)
    if not isinstance(recorded, dict) or found != recorded:
        recorded = recorded if isinstance(recorded, dict) else {}
        differ = sorted(n for n in set(found) | set(recorded) if found.get(n) != recorded.get(n))
        raise refuse("files", it_dir, f"{len(differ)} file(s) differ from the manifest's sha256 "
                     f"(missing, added or changed): {differ[:5]}",
                     "restore the folder from the writer")  # fmt: skip
    check_metadata(it_dir)


def manifest_config(manifest: dict[str, Any]) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.from_hf(manifest["model_config"])


def check_compatible(
    it_dir: Path, manifest: dict[str, Any], cfg: Qwen3MoeConfig, layout: ParallelLayout,
    dtype: torch.dtype, *, optimizer: dict[str, Any] | None,
) -> None:  # fmt: skip
    """Refuse loading this checkpoint into the run: model, dtype, layout, optimizer.

    `optimizer` is what the run's optimizer is (`sub_optimizers`, `distributed`), None for a
    model-only load.
    """
    saved = manifest_config(manifest)
    for f in fields(Qwen3MoeConfig):
        if f.name in MODEL_FIELDS_IGNORED:
            continue
        a, b = getattr(saved, f.name), getattr(cfg, f.name)
        if a != b:
            raise refuse(
                "model_config",
                it_dir,
                f"the checkpoint's {f.name} = {a!r}, the run's model has {f.name} = {b!r}",
                "load it into the model it was saved from (the run config's [model])",
            )
    want = dtype_name(dtype)
    if manifest["dtype"] != want:
        raise refuse("dtype", it_dir, f"saved in {manifest['dtype']}, the run's model is {want}",
                     f"set model.dtype = {manifest['dtype']!r}")  # fmt: skip
    check_layout(cfg, layout, it_dir)
    if optimizer is None:
        return
    if not manifest.get("has_optimizer"):
        raise refuse("optimizer_saved", it_dir, "holds the model only; the optimizer "
                     "state was requested", "load the model only (optimizer=None)")  # fmt: skip
    saved_opt = manifest["optimizer"]
    here, there = layout_dict(layout), manifest["layout"]
    if saved_opt["sharding_type"] != SHARDING and here != there:
        raise refuse(
            "optimizer_reshardable",
            it_dir,
            f"optimizer state saved {saved_opt['sharding_type']!r} at "
            f"{layout_name(there)}, which reads back at that layout only, not at "
            f"{layout_name(here)}",
            "load at the saving layout, or load the model only",
        )
    if saved_opt["sub_optimizers"] != optimizer["sub_optimizers"]:
        raise refuse(
            "optimizer_layout",
            it_dir,
            f"the optimizer was saved at {layout_name(there)} as "
            f"{saved_opt['sub_optimizers']} chained optimizer(s), the run at "
            f"{layout_name(here)} has {optimizer['sub_optimizers']}: megatron-core keeps the "
            "experts' state in a separate optimizer exactly when EP > 1 or ETP != TP, so its "
            "state cannot cross between EP = 1 and EP > 1",
            "load the model only (and start the optimizer afresh), or load at a layout with "
            + ("EP > 1" if saved_opt["sub_optimizers"] > 1 else "EP = 1 and ETP = TP"),
        )
    if saved_opt["distributed"] != optimizer["distributed"]:
        kind = {True: "distributed", False: "non-distributed"}
        raise refuse(
            "optimizer_kind",
            it_dir,
            f"a {kind[saved_opt['distributed']]} optimizer's state, the run has a "
            f"{kind[optimizer['distributed']]} one",
            "build the same kind of optimizer, or load the model only",
        )


def load(
    path: str | os.PathLike,
    model: Any,
    *,
    optimizer: Any = None,
    cfg: Qwen3MoeConfig,
    layout: ParallelLayout,
) -> dict[str, Any]:
    """Load a checkpoint (a root's `latest`, or an iter_N folder) into this rank's `model` (and
    `optimizer`) at `layout`; every rank calls it. Returns the manifest."""
    from megatron.core import dist_checkpointing

    gpt = single_chunk(model)
    it_dir, manifest, error = None, None, None
    if dist.get_rank() == 0:
        try:
            it_dir, manifest = read_manifest(path)
            verify(it_dir, manifest)
            opt = _optimizer_info(optimizer) if optimizer is not None else None
            check_compatible(it_dir, manifest, cfg, layout, gpt.config.params_dtype,
                             optimizer=opt)  # fmt: skip
        except CheckpointError as e:
            error = e
    _agree(error)
    box = [str(it_dir), manifest]
    dist.broadcast_object_list(box, src=0)
    it_dir, manifest = Path(box[0]), box[1]
    sd: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=SHARDED_METADATA)}
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd["model"], is_loading=True, metadata=SHARDED_METADATA
        )
    loaded = dist_checkpointing.load(sd, str(it_dir))
    gpt.load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    dist.barrier()
    return manifest


def global_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every global tensor of a checkpoint (model and optimizer, layers stacked), read in one
    process without a process group: for inspecting and comparing checkpoints."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    it_dir, manifest = read_manifest(path)
    verify(it_dir, manifest)
    # Straight from the shards into fresh tensors: no intermediate torch.save / torch.load.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        state = _load_state_dict_from_keys(checkpoint_id=str(it_dir))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
