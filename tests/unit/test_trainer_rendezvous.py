"""The GRPO trainers' rendezvous: trainer rank 0 binds the process group's store itself, on
run.bind_address and a port of the OS's pick, before the other ranks are told the port. A port
picked free and bound later could be taken by another process in between."""

from __future__ import annotations

from datetime import timedelta

import psutil
import torch.distributed as dist
from onpolicy.grpo.actors import TrainerActor, TrainerSpec
from onpolicy.layout import ParallelLayout


def test_rank_0_binds_the_store_before_it_names_the_port():
    spec = TrainerSpec(layout=ParallelLayout(world=2), dtype="float32", device="cpu", ckpt="",
                       master_addr="127.0.0.1", optimizer=None, loss=None, sync=None,
                       temperature=1.0, micro_batch_tokens=64)  # fmt: skip
    rank0 = TrainerActor(0, spec)
    port = rank0.open_rendezvous()
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    # A rank joining now reaches rank 0's store: the port was bound when it was named.
    other = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    other.set("rank1", "joined")
    assert rank0._store.get("rank1") == b"joined"
