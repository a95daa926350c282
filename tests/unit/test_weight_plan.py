"""The weight-sync plan without processes: items, shard groups, box coverage, config refusals."""

from __future__ import annotations

import math

import pytest
import torch
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import hf_tensor_shapes
from onpolicy.models.tiny import TINY
from onpolicy.train.hf_megatron import hf_tensors_of
from onpolicy.weights import SyncConfig, covers, group_ranks, sync_items
from onpolicy.weights.gather import _join


def test_items_join_to_the_hf_shapes():
    """Every item's global shape maps onto HF tensors of exactly the checkpoint's shapes."""
    shapes = hf_tensor_shapes(TINY)
    seen = {}
    for it in sync_items(TINY, ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)):
        for name, t in hf_tensors_of(TINY, it.base, torch.empty(it.shape, device="meta"),
                                     it.layer, it.expert):  # fmt: skip
            seen[name] = tuple(t.shape)
    assert seen == shapes


def test_groups_are_the_first_replica_in_shard_order():
    layout = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)  # dp 2, edp 1
    qkv = [it for it in sync_items(TINY, layout) if it.local.endswith("linear_qkv.weight")]
    # Both stages call their first layer decoder.layers.0; global layers 0 and 2.
    assert [(it.local, it.layer, it.stage) for it in qkv[::2]] == [
        ("decoder.layers.0.self_attention.linear_qkv.weight", 0, 0),
        ("decoder.layers.0.self_attention.linear_qkv.weight", 2, 1)]  # fmt: skip
    # Each comes from DP rank 0's TP group of its stage (stage 1 is ranks 4..7).
    assert [group_ranks(it, layout) for it in qkv[::2]] == [[0, 1], [4, 5]]
    # An expert of EP rank 1 at stage 1 lives on rank 5 alone (ETP 1).
    e = [it for it in sync_items(TINY, layout) if it.expert == 7 and it.stage == 1][0]
    assert group_ranks(e, layout) == [5]


def test_fc1_shards_join_as_gates_then_ups():
    """Each ETP rank holds [gate_r; up_r]; the join must give [gate; up], not interleave."""
    it = [x for x in sync_items(TINY, ParallelLayout(world=2, tp=2, etp=2, sp=True))
          if x.base.endswith("linear_fc1.weight")][0]  # fmt: skip
    gate, up = torch.arange(4.0)[:, None], torch.arange(4.0, 8.0)[:, None]
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]
    assert torch.equal(_join(it, shards), torch.cat([gate, up]))
    assert not torch.equal(torch.cat(shards), torch.cat([gate, up]))  # the naive join differs


def test_box_coverage():
    assert covers([[[0, 4], [0, 2]]], [4, 2])
    assert covers([[[0, 2], [0, 2]], [[2, 4], [0, 2]]], [4, 2])
    assert covers([[[0, 4], [0, 1]], [[0, 4], [1, 2]]], [4, 2])
    assert not covers([[[0, 2], [0, 2]]], [4, 2])
    assert not covers([[[0, 2], [0, 2]], [[3, 4], [0, 2]]], [4, 2])
    assert not covers([], [4, 2])


def test_bad_sync_configs_are_refused():
    with pytest.raises(ValueError, match="transport 'ipc' is not one of"):
        SyncConfig(transport="ipc")
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        SyncConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="4 layers over PP=3"):
        sync_items(TINY, ParallelLayout(world=3, pp=3))


def test_every_byte_is_sent_once():
    items = sync_items(TINY, ParallelLayout(world=4, pp=2, ep=2))
    total = sum(math.prod(it.shape) for it in items)
    assert total == sum(math.prod(s) for s in hf_tensor_shapes(TINY).values())
