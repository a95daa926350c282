"""Full HF tensors from a Megatron model at any TP/PP/EP/ETP, streamed to global rank 0.

Every trainer rank walks the same `sync_items` list. For each tensor, the ranks of the group
that holds it (`names.group_ranks`) gather their shards to the group's first rank, which joins
them (concatenation only: no arithmetic, so the bits are the trainer's) and sends the result to
global rank 0 unless it is rank 0. Rank 0 yields the HF (name, tensor) pairs; the others yield
nothing but must run the generator to the end, since they take part in the gathers. One tensor
is in flight at a time, so no rank ever holds more than one full tensor beyond its own shards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from onpolicy.layout import ParallelLayout
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.hf_megatron import hf_tensors_of
from onpolicy.train.megatron_model import unwrap
from onpolicy.weights.names import Item, group_ranks, sync_items


def _join(item: Item, shards: list[torch.Tensor]) -> torch.Tensor:
    if item.join == "rep" or len(shards) == 1:
        return shards[0]
    if item.join == "cat0":
        return torch.cat(shards, dim=0)
    if item.join == "cat1":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]  # fc1: [gate_r; up_r] per rank
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in unwrap(model).named_parameters()}


def _groups(items: list[Item], layout: ParallelLayout) -> dict[tuple[int, ...], object]:
    """One gloo/NCCL group per distinct set of gathering ranks (every rank creates each)."""
    groups: dict[tuple[int, ...], object] = {}
    for it in items:
        ranks = tuple(group_ranks(it, layout))
        if len(ranks) > 1 and ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks))
    return groups


class Gatherer:
    """The gather plan of one model at one layout; build once, `iterate` every sync."""

    def __init__(self, model: torch.nn.Module, cfg: Qwen3MoeConfig, layout: ParallelLayout):
        self.model, self.cfg, self.layout = model, cfg, layout
        self.items = sync_items(cfg, layout)
        self.groups = _groups(self.items, layout)
        self.rank = dist.get_rank()
        params = _params(model)
        dtypes = sorted({str(p.dtype) for p in params.values()})
        if len(dtypes) != 1:
            raise ValueError(f"weight sync: the model's parameters have several dtypes {dtypes}; "
                             "the receiving rank allocates one")  # fmt: skip
        mine = {it.local for it in self.items if self.rank in group_ranks(it, layout)}
        missing = sorted(mine - set(params))
        if missing:
            raise ValueError(
                f"weight sync: rank {self.rank} at {layout.degrees()} should hold "
                f"{len(missing)} tensors the model does not have, e.g. {missing[:3]}"
            )

    def iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, full tensor) on rank 0, in checkpoint order; nothing on other ranks."""
        params = _params(self.model)
        device = next(iter(params.values())).device
        dtype = next(iter(params.values())).dtype
        for it in self.items:
            ranks = group_ranks(it, self.layout)
            src = ranks[0]
            full = None
            if self.rank in ranks:
                shard = params[it.local].contiguous()
                if len(ranks) > 1:
                    bufs = [torch.empty_like(shard) for _ in ranks] if self.rank == src else None
                    dist.gather(shard, bufs, dst=src, group=self.groups[tuple(ranks)])
                    if self.rank == src:
                        full = _join(it, bufs)
                else:
                    full = shard
            if src != 0:
                if self.rank == src:
                    dist.send(full.contiguous(), dst=0)
                elif self.rank == 0:
                    full = torch.empty(it.shape, dtype=dtype, device=device)
                    dist.recv(full, src=src)
            if self.rank == 0:
                if tuple(full.shape) != it.shape:
                    raise RuntimeError(f"weight sync: {it.local} joined to {tuple(full.shape)}, "
                                       f"expected {it.shape}")  # fmt: skip
                yield from hf_tensors_of(self.cfg, it.base, full, it.layer, it.expert)
