"""The collectives' argument checks and the one-rank case, in this process (a gloo group of 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from onpolicy.collectives import (
    all_gather,
    ep_combine,
    ep_dispatch,
    reduce_scatter,
    sequence_split_sizes,
    tree_all_reduce,
)
from onpolicy.contract import ContractError


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sequence_split_sizes() -> None:
    assert sequence_split_sizes(10, 4) == [3, 3, 2, 2]
    assert sequence_split_sizes(8, 4) == [2, 2, 2, 2]
    assert sequence_split_sizes(2, 4) == [1, 1, 0, 0]


def test_one_rank_is_the_identity(one_rank) -> None:
    x = torch.randn(5, 3)
    for y in (tree_all_reduce(x), tree_all_reduce(x, algo="scatter_gather"), reduce_scatter(x),
              all_gather(x)):  # fmt: skip
        assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    ids = torch.tensor([[1, 0], [2, 1]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    rows, route = ep_dispatch(x[:2], ids, 3)
    assert route.expert_ids.tolist() == [0, 1, 1, 2]  # sorted by expert id, token order kept
    out = ep_combine(rows * 2, w, route)
    assert torch.equal(out, (2 * x[:2]))  # halves of equal outputs: exact


def test_bad_split_sizes_are_refused(one_rank) -> None:
    with pytest.raises(ContractError, match=r"\[split_sizes\] reduce_scatter: split_sizes \[2\]"):
        reduce_scatter(torch.zeros(5, 2), split_sizes=[2])
    with pytest.raises(ContractError, match=r"rank 0 holds 5 rows but split_sizes is \[4\]"):
        all_gather(torch.zeros(5, 2), split_sizes=[4])


def test_unknown_all_reduce_algo_is_refused(one_rank) -> None:
    with pytest.raises(ContractError, match=r"\[all_reduce_algo\] .*'ring'"):
        tree_all_reduce(torch.zeros(2), algo="ring")
