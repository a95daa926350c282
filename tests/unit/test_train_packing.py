"""Packing of scored sequences for the Megatron forward: THD layout, targets, the DP deal."""

from __future__ import annotations

import pytest
import torch
from onpolicy.train.logprobs import PackedBatch, plan_micro_batches


def test_pack_pads_with_its_own_segment_and_targets_stay_inside_each_sequence():
    b = PackedBatch.pack([[5, 6, 7], [8], [9, 10]], multiple_of=4)
    assert b.tokens.tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6, 8] and b.cu_seqlens.dtype == torch.int32
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1, 0, 1]
    assert b.targets.tolist() == [6, 7, 0, 0, 10, 0, 0, 0]
    assert b.spans == [(0, 3), (3, 4), (4, 6)]
    values = torch.arange(8.0)
    assert [v.tolist() for v in b.split(values)] == [[0.0, 1.0], [], [4.0]]
    psp = b.packed_seq_params()
    assert psp.qkv_format == "thd" and psp.max_seqlen_q == 3
    assert torch.equal(psp.cu_seqlens_q, b.cu_seqlens)


def test_pack_without_padding_and_an_empty_micro_batch():
    assert PackedBatch.pack([[1, 2], [3, 4]], multiple_of=2).cu_seqlens.tolist() == [0, 2, 4]
    empty = PackedBatch.pack([], multiple_of=2)
    assert empty.num_sequences == 0 and empty.tokens.tolist() == [0, 0] and empty.spans == []
    with pytest.raises(ValueError, match="empty sequence"):
        PackedBatch.pack([[1], []])


def test_plan_deals_contiguous_shares_within_the_budget_and_pads_to_one_count():
    lengths = [23, 5, 40, 2, 17, 33, 1, 12]
    assert plan_micro_batches(lengths, 1, 64) == [[[0, 1], [2, 3, 4], [5, 6, 7]]]
    assert plan_micro_batches(lengths, 2, 64) == [[[0, 1], [2, 3]], [[4, 5, 6, 7], []]]
    # A sequence longer than the budget runs alone; replicas without sequences still run.
    assert plan_micro_batches([100, 3], 1, 64) == [[[0], [1]]]
    assert plan_micro_batches([3], 4, 64) == [[[0]], [[]], [[]], [[]]]
    assert plan_micro_batches([], 2, 64) == [[[]], [[]]]
