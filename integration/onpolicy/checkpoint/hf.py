"""Atomic HF safetensors checkpoints of a Qwen3-MoE: write it whole or leave nothing.

Reading (strict, all or nothing) is `onpolicy.models.hf_layout.read_hf_checkpoint`. Writing
validates the same way first, builds the whole checkpoint in a temporary sibling, fsyncs it,
renames it into place and writes the completion marker last, so an interrupted writer never
leaves anything that looks like a checkpoint, and an existing folder is never overwritten.

Every refusal is a `CheckpointError` naming the file, the tensor (if any) and the rule.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from onpolicy.fsutil import fsync_path, write_atomic, write_synced
from onpolicy.models.hf_layout import (
    INDEX,
    CheckpointError,
    TensorSpec,
    check_specs,
    hf_config_of,
)

COMPLETE = ".onpolicy-complete"
"""Marker file a finished write leaves in the checkpoint folder, written last."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""Files a source checkpoint's weights may live in; never copied beside the new weights."""


def is_complete(path: str | os.PathLike) -> bool:
    """The folder carries the marker a finished `write_hf_checkpoint` leaves."""
    return (Path(path) / COMPLETE).is_file()


# ---- writing ---------------------------------------------------------------------------------


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split in order, starting a new shard when the next tensor would pass `max_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU contiguous tensors, each alone in its storage (safetensors refuses shared memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage()
        shared = storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size()
        if shared and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _remove_stale(parent: Path, name: str) -> None:
    """Remove temporaries of `name` whose writer process is gone (killed mid-write)."""
    for tmp in parent.iterdir():
        m = re.fullmatch(rf"\.{re.escape(name)}\.tmp-(\d+)-[A-Za-z0-9_]+", tmp.name)
        if not m or not tmp.is_dir():
            continue
        try:
            os.kill(int(m[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _refuse_existing(out: Path) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink():
        if is_complete(out):
            raise CheckpointError("hf_out_exists", out, "already holds a complete checkpoint")
        if any(out.iterdir()):
            raise CheckpointError("hf_out_exists", out, "exists and is not empty; not overwritten")
        return
    what = "a symlink" if out.is_symlink() else "not a directory"
    raise CheckpointError("hf_out_exists", out, f"exists and is {what}; not overwritten")


def _source_root(source: Path) -> Path:
    """Where the source folder's links may point: the folder itself, or for a snapshot of the
    HF hub cache (`models--ORG--NAME/snapshots/REV`, files linked to `../../blobs/HASH`) its
    repository folder."""
    root = source.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return root


def _copy_source(source: Path, tmp: Path) -> None:
    """Copy the source folder's tokenizer and other small files. A link is followed only into
    the source's own folder (a hub snapshot's blobs): one pointing elsewhere would copy a file
    the checkpoint does not hold (a key, a password file) into the output, so it is refused."""
    root = _source_root(source)
    for f in sorted(source.iterdir()):
        name = f.name
        if (not f.is_file() or name.startswith(".") or name == "config.json"
                or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
                or name.startswith("onpolicy-")):  # fmt: skip
            continue
        target = f.resolve()
        if f.is_symlink() and root not in target.parents:
            raise CheckpointError("hf_source_link", f, f"links to {target}, outside the source "
                                  f"checkpoint {root}; not copied")  # fmt: skip
        shutil.copyfile(target, tmp / name)
        fsync_path(tmp / name)


def write_hf_checkpoint(
    out: str | os.PathLike,
    config_json: dict,
    tensors: dict[str, torch.Tensor],
    *,
    source: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write a checked HF checkpoint to `out` atomically and return its path.

    `source` is an HF checkpoint folder whose non-weight files (tokenizer, generation config,
    ...) are copied; never its weights or index. `out` must not exist or be an empty folder.
    """
    out = Path(os.path.abspath(out))
    if max_shard_bytes < 1:
        raise CheckpointError("hf_shard_size", out, f"max_shard_bytes={max_shard_bytes} < 1")
    cfg, cfg_dtype = hf_config_of(config_json, out / "config.json")
    bad = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise CheckpointError("hf_tensor_type", out, f"is a {type(tensors[bad[0]])}", bad[0])
    specs = {k: TensorSpec(t.dtype, tuple(t.shape), out) for k, t in tensors.items()}
    check_specs(cfg, specs, cfg_dtype, True, out)
    if source is not None and not Path(source).is_dir():
        raise CheckpointError("hf_source", source, "source is not a checkpoint directory")
    try:
        config_text = json.dumps(config_json, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            "hf_config", out / "config.json", f"not JSON-serialisable: {e}"
        ) from None
    _refuse_existing(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out.parent, out.name)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
    try:
        _write_into(tmp, config_text, tensors, source, max_shard_bytes)
        _refuse_existing(out)
        try:
            os.rename(tmp, out)  # replaces only an empty folder; never a user's files
        except OSError as e:
            raise CheckpointError("hf_out_exists", out, f"appeared while writing: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = json.dumps({"files": sorted(f.name for f in out.iterdir())}) + "\n"
    write_atomic(out / COMPLETE, files)  # the marker last; write_atomic fsyncs `out`
    fsync_path(out.parent)
    return out


def _write_into(tmp: Path, config_text: str, tensors: dict[str, torch.Tensor],
                source: str | os.PathLike | None, max_shard_bytes: int) -> None:  # fmt: skip
    from safetensors.torch import save_file

    write_synced(tmp / "config.json", config_text)
    shards = _shards(tensors, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(_own_storage(shard), tmp / name, {"format": "pt"})
        fsync_path(tmp / name)
        weight_map |= dict.fromkeys(shard, name)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_synced(tmp / INDEX, json.dumps(index, indent=2) + "\n")
    if source is not None:
        _copy_source(Path(source), tmp)
    fsync_path(tmp)
