"""`onpolicy.rollout.ops.shard_rows` gives, for every id, the row and the outside mask that
SGLang's `get_masked_input_and_mask` gives (its function as written, without its
`torch.compile`), for SGLang's own shard indices at TP 2, 3 and 4, with a padded vocabulary and
with added (LoRA) rows. Control: another rank's indices give other rows."""

from __future__ import annotations

import pytest
import torch
from onpolicy.rollout.ops import shard_rows
from sglang.srt.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
    get_masked_input_and_mask,
)

SGLANG = get_masked_input_and_mask._torchdynamo_orig_callable  # the source, not a compile


def indices(tp: int, rank: int, org: int, added: int):
    pad_to = 64 * tp  # each rank's shard a whole number of 64-row blocks
    org_padded = -(-org // pad_to) * pad_to
    padded = org_padded + -(-added // pad_to) * pad_to
    return VocabParallelEmbedding._get_indices(padded, org_padded, org + added, org, rank, tp)


def sglang_rows(ids, s):
    return SGLANG(ids, s.org_vocab_start_index, s.org_vocab_end_index, s.num_org_vocab_padding,
                  s.added_vocab_start_index, s.added_vocab_end_index)  # fmt: skip


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("added", [0, 5])
def test_shard_rows_are_sglangs(tp, added):
    org = 1000
    ids = torch.arange(org + added, dtype=torch.int64)
    owners = torch.zeros_like(ids)
    for rank in range(tp):
        s = indices(tp, rank, org, added)
        rows, outside = shard_rows(ids, s)
        want_rows, want_outside = sglang_rows(ids, s)
        assert rows.dtype == want_rows.dtype, (rows.dtype, want_rows.dtype)
        assert torch.equal(rows, want_rows), (tp, rank)
        assert torch.equal(outside, want_outside), (tp, rank)
        owners += (~outside).long()
    assert torch.equal(owners, torch.ones_like(ids))  # every id has exactly one owner


def test_negative_control_another_ranks_indices_give_other_rows():
    ids = torch.arange(1005, dtype=torch.int64)
    rows, outside = shard_rows(ids, indices(2, 1, 1000, 5))
    want_rows, want_outside = sglang_rows(ids, indices(2, 0, 1000, 5))
    assert not torch.equal(outside, want_outside)
    assert not torch.equal(rows, want_rows)
