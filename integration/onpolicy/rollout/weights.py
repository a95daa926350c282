"""What one SGLang rank holds, in HF names: the engine side of the weight-sync check.

After a sync the trainer asks every engine for a report (`write_report`, run on every TP rank
of an engine by the patched scheduler's `onpolicy_report_weights`). Each SGLang parameter is
mapped back to the HF tensor it came from and the box of that tensor this rank holds: a row or
column range for TP shards, the whole tensor for replicated ones. The digest is a SHA-256 of the
box's bytes, so the trainer, which holds the full HF tensors, can hash the same box and compare
without moving a weight back. A parameter that maps to no HF tensor is reported as such: the
check refuses it rather than passing over a buffer nobody syncs.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

Box = list[list[int]]
"""Per dim of the HF tensor, [start, stop)."""
PADDING = "(padding)"
"""The HF name reported for padding SGLang adds to a buffer: it must hold zeros."""


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (contiguous, on the CPU): equal digests, equal bits."""
    flat = t.detach().contiguous().view(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


class Hasher:
    """`digest` on a few threads: a sync checks gigabytes, and both the copy to the host and
    hashlib's SHA-256 release the GIL. `submit` returns a future; at most two per thread wait
    at a time, so the host copies, and any gathered tensor a waiting one keeps alive, stay
    bounded."""

    def __init__(self, threads: int = 8) -> None:
        self.threads = max(1, min(threads, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="digest")
        self._waiting: set[Future] = set()

    def submit(self, t: torch.Tensor) -> Future:
        while len(self._waiting) >= 2 * self.threads:
            _done, self._waiting = wait(self._waiting, return_when=FIRST_COMPLETED)
        f = self._pool.submit(digest, t)
        self._waiting.add(f)
        return f

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def digests(tensors: list[torch.Tensor]) -> list[str]:
    """`digest` of each tensor, in order (`Hasher`)."""
    with Hasher() as h:
        futures = [h.submit(t) for t in tensors]
        return [f.result() for f in futures]


def _rows(start: int, stop: int, cols: int) -> Box:
    return [[start, stop], [0, cols]]


def held_boxes(model: torch.nn.Module) -> list[tuple[str, str, Box, torch.Tensor]]:
    """(sglang name, HF name or "", box, held values) of every parameter of this rank."""
    from sglang.srt.distributed.utils import get_group_rank_size

    modules = dict(model.named_modules())
    out: list[tuple[str, str, Box, torch.Tensor]] = []
    for name, p in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]]
        leaf = name.rsplit(".", 2)[-2] if "." in name else name
        w = p.data
        if leaf in ("embed_tokens", "lm_head"):
            idx = owner.shard_indices
            n = idx.org_vocab_end_index - idx.org_vocab_start_index
            hf = "model.embed_tokens.weight" if leaf == "embed_tokens" else "lm_head.weight"
            box = _rows(idx.org_vocab_start_index, idx.org_vocab_end_index, w.shape[1])
            out.append((name, hf, box, w[:n]))
        elif leaf == "qkv_proj":
            rank, _ = get_group_rank_size(owner.tp_group)
            kv_rank, _ = get_group_rank_size(owner.kv_tp_group)
            base = name.removesuffix("qkv_proj.weight")
            q, kv = owner.num_heads * owner.head_size, owner.num_kv_heads * owner.head_size
            kv_shard = kv_rank // owner.num_kv_head_replicas
            cols = w.shape[1]
            out.append((name, base + "q_proj.weight", _rows(rank * q, (rank + 1) * q, cols), w[:q]))
            for i, part in enumerate(("k_proj", "v_proj")):
                lo = q + i * kv
                box = _rows(kv_shard * kv, (kv_shard + 1) * kv, cols)
                out.append((name, f"{base}{part}.weight", box, w[lo : lo + kv]))
        elif leaf == "o_proj":
            rank, _ = get_group_rank_size(owner.tp_group)
            k = w.shape[1]
            out.append((name, name, [[0, w.shape[0]], [rank * k, (rank + 1) * k]], w))
        elif name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight"):
            # SGLang's CPU path pads the width to an alignment and keeps the checkpoint's.
            c = model.config
            inter = getattr(c, "original_moe_intermediate_size", c.moe_intermediate_size)
            inter //= owner.moe_tp_size
            out.extend(_expert_boxes(name, owner, w, inter))
        elif leaf in ("gate", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                      "norm"):  # fmt: skip
            out.append((name, name, [[0, s] for s in w.shape], w))
        else:
            out.append((name, "", [[0, s] for s in w.shape], w))
    return out


def _expert_boxes(name: str, moe: torch.nn.Module, w: torch.Tensor, inter: int):
    """FusedMoE's [local expert, rows, cols] stacks: expert ep_rank * n_local + j, and the
    moe_tp_rank-th slice (`inter` wide) of its intermediate dim (w13: [gate; up] rows, w2:
    columns). SGLang may pad each half beyond `inter`; the padding is reported on its own, as
    it takes part in the expert GEMMs and must hold zeros."""
    base = name.rsplit("experts.", 1)[0] + "experts."
    n_local, first = moe.num_local_experts, moe.moe_ep_rank * moe.num_local_experts
    r = moe.moe_tp_rank
    for j in range(n_local):
        e = f"{base}{first + j}."
        if name.endswith("w13_weight"):
            half, cols = w.shape[1] // 2, w.shape[2]
            box = _rows(r * inter, (r + 1) * inter, cols)
            yield name, e + "gate_proj.weight", box, w[j, :inter]
            yield name, e + "up_proj.weight", box, w[j, half : half + inter]
            pads = [w[j, inter:half], w[j, half + inter :]]
        else:
            box = [[0, w.shape[1]], [r * inter, (r + 1) * inter]]
            yield name, e + "down_proj.weight", box, w[j, :, :inter]
            pads = [w[j, :, inter:]]
        for pad in pads:
            if pad.numel():
                yield name, PADDING, [[0, s] for s in pad.shape], pad


def report(model: torch.nn.Module) -> list[dict]:
    """This rank's entries: {param, name (HF, "" if none), box, shape, dtype, sha256}; shape
    is what the rank holds for the box, so a box that does not fit is seen as such."""
    held = held_boxes(model)
    sums = digests([t for _p, _hf, _box, t in held])
    return [{"param": p, "name": hf, "box": box, "shape": list(t.shape),
             "dtype": str(t.dtype).removeprefix("torch."), "sha256": sha,
             "zero": bool((t == 0).all()) if hf == PADDING else None}
            for (p, hf, box, t), sha in zip(held, sums, strict=True)]  # fmt: skip


def write_report(model: torch.nn.Module, path: str, tp_rank: int) -> None:
    """`report(model)` as `path/rank{tp_rank}.json`, written to a temp name and renamed."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{tp_rank}.json.tmp"
    tmp.write_text(json.dumps(report(model)))
    os.replace(tmp, out / f"rank{tp_rank}.json")
