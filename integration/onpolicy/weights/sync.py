"""Megatron -> N SGLang engines: full HF tensors in buckets, a new weight version, then checked.

Collective over the trainer ranks (they take part in the gathers); only global rank 0 talks to
engines, each an `onpolicy.rollout.engine.EngineHandle` (a host's client, a rollout actor's
proxy): an op is sent to every engine first and collected after rank 0's own part (joining the
group, broadcasting the bucket), so the engines receive while rank 0 sends. A sync is one
weight-update session per engine (begin, buckets, end). Buckets hold whole tensors up to
`bucket_bytes` (a larger tensor goes alone); the last one flushes the engines' caches and sets
the version. Transports:
- "distributed": one process group of trainer rank 0 plus every engine's TP ranks (gloo on
  CPU, NCCL on GPU); one broadcast per tensor reaches all engines, each rank keeping its shard
  or its own experts (SGLang's weight loaders slice the full tensor).
- "tensor": colocated engines get each bucket as shared-memory tensor handles, one payload per
  TP rank (`update_weights_from_tensor`).
`verify` then asks every engine what it holds (`onpolicy.rollout.weights`), hashes the same
boxes of the trainer's tensors, and names every tensor and engine that differ.
"""

from __future__ import annotations

import hashlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from onpolicy.rollout.engine import EngineHandle, EngineOp, join_update_group, tensor_payloads
from onpolicy.rollout.weights import PADDING, Hasher
from onpolicy.weights.gather import Gatherer

TRANSPORTS = ("distributed", "tensor")


class WeightSyncError(RuntimeError):
    """A sync an engine refused, or a check that found an engine holding other weights."""


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """How weights travel to the engines."""

    transport: str = "distributed"
    """"distributed" (a broadcast group with the engines) or "tensor" (colocated handles)."""
    bucket_bytes: int = 64 << 20
    """Byte budget of one update call; a tensor larger than it travels alone."""
    backend: str = "gloo"
    """Process-group backend of the distributed transport: gloo on CPU, nccl on GPU."""
    group_name: str = "onpolicy_weight_sync"
    """Name of the weight-update group on the engines."""
    address: str = "127.0.0.1"
    """Address of the group's rendezvous, hosted by trainer rank 0 (a run sets run.bind_address)."""
    timeout_s: float = 900.0
    """How long to wait for an engine's reply or the group's rendezvous."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight sync: transport {self.transport!r} is not one of "
                             f"{TRANSPORTS}")  # fmt: skip
        if self.bucket_bytes < 1:
            raise ValueError(f"weight sync: bucket_bytes must be positive, got {self.bucket_bytes}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"weight sync: timeout_s must be finite and above 0, got "
                             f"{self.timeout_s}")  # fmt: skip


@dataclass(slots=True)
class SyncStats:
    """What one sync moved (rank 0's view)."""

    version: str
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class CheckReport:
    """The outcome of `verify`: boxes compared, and every difference found."""

    tensors: int = 0
    boxes: int = 0
    mismatches: list[str] = field(default_factory=list)
    sha256: str = ""
    """One digest of every box the engines hold (engine, rank, tensor, box and the box's
    SHA-256, in the trainer's tensor order): two syncs with equal digests gave the engines the
    same bits."""


class WeightSync:
    """Syncs one trainer model into `engines` (given on global rank 0, empty elsewhere)."""

    def __init__(self, gatherer: Gatherer, engines: list[EngineHandle], config: SyncConfig):
        self.gatherer, self.config = gatherer, config
        self.rank = dist.get_rank()
        self.engines = engines if self.rank == 0 else []
        if self.rank == 0 and not engines:
            raise ValueError("weight sync: global rank 0 needs at least one engine")
        self.group = None

    # --- the distributed transport's group ----------------------------------------------------
    def _connect(self) -> None:
        from datetime import timedelta

        from onpolicy.rendezvous import tcp_store

        c = self.config
        world = 1 + sum(e.tp for e in self.engines)
        store = tcp_store(c.address, 0, world, is_master=True,
                          timeout=timedelta(seconds=c.timeout_s))  # fmt: skip
        offset = 1
        for e in self.engines:
            e.send("init_weights_update_group", master_address=c.address, master_port=store.port,
                   rank_offset=offset, world_size=world, group_name=c.group_name,
                   backend=c.backend)  # fmt: skip
            offset += e.tp
        self.group = join_update_group(backend=c.backend, store=store, world_size=world,
                                       group_name=c.group_name,
                                       timeout=timedelta(seconds=c.timeout_s))  # fmt: skip
        self._store = store
        self._all("init_weights_update_group")

    def _all(self, what: str) -> None:
        """Collect one pending reply from every engine; SGLang's (success, message) checked."""
        for e in self.engines:
            value = e.result(self.config.timeout_s)
            if isinstance(value, tuple) and len(value) == 2 and value[0] is False:
                raise WeightSyncError(f"{e.name}: {what} refused: {value[1]}")

    def _call_all(self, op: EngineOp, **kw) -> None:
        for e in self.engines:
            e.send(op, **kw)
        self._all(op)

    # --- sync ------------------------------------------------------------------------------------
    def sync(self, version: str) -> SyncStats | None:
        """Move every tensor; the engines serve `version` afterwards. Stats on rank 0."""
        t0 = time.perf_counter()
        stats = SyncStats(version=version)
        if self.rank == 0:
            if self.config.transport == "distributed" and self.group is None:
                self._connect()
            self._call_all("begin_weight_update")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        try:
            for name, t in self.gatherer.iterate():
                if bucket and size + t.nbytes > self.config.bucket_bytes:
                    self._send(bucket, version=None, stats=stats)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.nbytes
            if self.rank == 0:
                self._send(bucket, version=version, stats=stats)
        finally:
            if self.rank == 0:
                self._call_all("end_weight_update")
        if self.rank != 0:
            return None
        for e in self.engines:
            held = e.call("info", timeout=self.config.timeout_s)["weight_version"]
            if held != version:
                raise WeightSyncError(f"{e.name}: serves weight version {held!r} after the sync, "
                                      f"expected {version!r}")  # fmt: skip
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None,
              stats: SyncStats) -> None:  # fmt: skip
        last = version is not None
        if self.config.transport == "distributed":
            names = [n for n, _ in bucket]
            for e in self.engines:
                e.send("update_weights_from_distributed", names=names,
                       dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                       shapes=[list(t.shape) for _, t in bucket], group_name=self.config.group_name,
                       flush_cache=last, weight_version=version)  # fmt: skip
            for _, t in bucket:
                dist.broadcast(t.contiguous(), src=0, group=self.group)
        else:
            # File-descriptor handles; the engine's ranks share our authkey (EngineClient.connect).
            shared = [(n, t.contiguous().share_memory_()) for n, t in bucket]
            for e in self.engines:
                e.send("update_weights_from_tensor",
                       serialized_named_tensors=tensor_payloads(shared, e.tp), flush_cache=last,
                       weight_version=version)  # fmt: skip
        self._all(f"update_weights_from_{self.config.transport}")
        stats.tensors += len(bucket)
        stats.bytes += sum(t.nbytes for _, t in bucket)
        stats.buckets += 1

    # --- the check -------------------------------------------------------------------------------
    def verify(self) -> CheckReport | None:
        """Compare every box every engine rank holds with the trainer's tensor; raise
        WeightSyncError naming each tensor and engine that differ. The report on rank 0."""
        wanted: dict[str, list[tuple[str, int, dict]]] = {}
        report = CheckReport()
        if self.rank == 0:
            for e in self.engines:
                ranks = e.call("report_weights", timeout=self.config.timeout_s)
                for r, entries in enumerate(ranks):
                    for x in entries:
                        if x["name"] == PADDING:
                            report.boxes += 1
                            if not x["zero"]:
                                report.mismatches.append(f"{e.name} rank {r}: {x['param']} has "
                                                         "padding that is not zero")  # fmt: skip
                            continue
                        if not x["name"]:
                            report.mismatches.append(f"{e.name} rank {r}: parameter {x['param']} "
                                                     "maps to no HF tensor, so no sync reaches "
                                                     "it")  # fmt: skip
                            continue
                        wanted.setdefault(x["name"], []).append((e.name, r, x))
        seen = set()
        held = hashlib.sha256()
        hashed: list[tuple[str, int, str, dict, Future]] = []  # compared once all are hashed
        with Hasher() as hasher:
            for name, t in self.gatherer.iterate():
                seen.add(name)
                report.tensors += 1
                self._check_tensor(name, t, wanted.get(name, []), report, hasher, hashed)
            for en, r, name, x, future in hashed:
                if x["sha256"] != future.result():
                    report.mismatches.append(f"{en} rank {r}: {name} box {x['box']} differs "
                                             "from the trainer's")  # fmt: skip
                else:
                    held.update(f"{en}/{r}/{name}/{x['box']}/{x['sha256']};".encode())
        if self.rank != 0:
            return None
        for name in sorted(set(wanted) - seen):
            report.mismatches.append(f"{wanted[name][0][0]}: holds {name}, which the trainer has "
                                     "no tensor for")  # fmt: skip
        if report.mismatches:
            raise WeightSyncError(
                f"weight check: {len(report.mismatches)} of {report.boxes} boxes differ or are "
                "missing:\n  " + "\n  ".join(report.mismatches[:20])
            )
        report.sha256 = held.hexdigest()
        return report

    def _check_tensor(self, name: str, t: torch.Tensor, holders: list[tuple[str, int, dict]],
                      report: CheckReport, hasher: Hasher,
                      hashed: list[tuple[str, int, str, dict, Future]]) -> None:  # fmt: skip
        """One trainer tensor against every box the engines report of it: coverage, shape and
        dtype now, the box's digest submitted to `hasher` (compared by `verify`)."""
        for e in self.engines:
            boxes = [x["box"] for en, _r, x in holders if en == e.name]
            if not covers(boxes, list(t.shape)):
                report.mismatches.append(f"{e.name}: {name} is not fully held by its ranks "
                                         f"(boxes {boxes}, shape {list(t.shape)})")  # fmt: skip
        dtype = str(t.dtype).removeprefix("torch.")
        for en, r, x in holders:
            report.boxes += 1
            part = t[tuple(slice(a, b) for a, b in x["box"])]
            if x["shape"] != list(part.shape):
                report.mismatches.append(f"{en} rank {r}: {name} box {x['box']} holds shape "
                                         f"{x['shape']}, the box is "
                                         f"{list(part.shape)}")  # fmt: skip
            elif x["dtype"] != dtype:
                report.mismatches.append(f"{en} rank {r}: {name} held as {x['dtype']}, the "
                                         f"trainer's is {dtype}")  # fmt: skip
            else:
                hashed.append((en, r, name, x, hasher.submit(part)))

    def close(self) -> None:
        """Leave the engines' weight-update group (rank 0)."""
        if self.group is not None:
            self._call_all("destroy_weights_update_group", group_name=self.config.group_name)
            dist.destroy_process_group(self.group)
            self.group = None


def covers(boxes: list[list[list[int]]], shape: list[int]) -> bool:
    """Whether boxes that each cut at most one dim tile `shape`."""
    full = [[0, s] for s in shape]
    if full in boxes:
        return True
    for d in range(len(shape)):
        spans = sorted(b[d] for b in boxes if all(b[k] == full[k] for k in range(len(shape))
                                                  if k != d))  # fmt: skip
        reach = 0
        for a, b in spans:
            if a > reach:
                break
            reach = max(reach, b)
        if spans and reach >= shape[d]:
            return True
    return False
