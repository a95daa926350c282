"""The collectives' argument checks and the one-rank case, in this process (a gloo group of 1),
and the shard-count arithmetic behind the power-of-2 rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from onpolicy import kernels as K
from onpolicy.bits import assert_bitwise, n_differ
from onpolicy.collectives import (
    all_gather,
    ep_combine,
    ep_dispatch,
    reduce_scatter,
    sequence_split_sizes,
    tree_all_reduce,
)
from onpolicy.contract import ContractError
from onpolicy.kernels.tree import pairwise_tree_sum


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
        assert_bitwise(y, x, "one-rank collective")
    ids = torch.tensor([[1, 0], [2, 1]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    rows, route = ep_dispatch(x[:2], ids, 3)
    assert route.expert_ids.tolist() == [0, 1, 1, 2]  # sorted by expert id, token order kept
    out = ep_combine(rows * 2, w, route)
    assert_bitwise(out, 2 * x[:2], "halves of equal outputs: exact")


def test_bad_split_sizes_are_refused(one_rank) -> None:
    with pytest.raises(ContractError, match=r"\[split_sizes\] reduce_scatter: split_sizes \[2\]"):
        reduce_scatter(torch.zeros(5, 2), split_sizes=[2])
    with pytest.raises(ContractError, match=r"rank 0 holds 5 rows but split_sizes is \[4\]"):
        all_gather(torch.zeros(5, 2), split_sizes=[4])


def test_unknown_all_reduce_algo_is_refused(one_rank) -> None:
    with pytest.raises(ContractError, match=r"\[all_reduce_algo\] .*'ring'"):
        tree_all_reduce(torch.zeros(2), algo="ring")


def _shard_tree(t: int, blocks_per_shard: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tree over t K-shards' fp32 partials, the unsharded fp32 sum) on wide-exponent bf16."""
    k = K.K_BLOCK * blocks_per_shard * t
    g = torch.Generator().manual_seed(seed)

    def wide(*shape: int) -> torch.Tensor:
        e = torch.randint(-12, 12, shape, generator=g).float()
        return (torch.randn(*shape, generator=g) * torch.exp2(e)).to(torch.bfloat16)

    x, w = wide(12, k), wide(8, k)
    ks = k // t
    parts = [K.linear_partial(x[:, r * ks : (r + 1) * ks], w[:, r * ks : (r + 1) * ks])
             for r in range(t)]  # fmt: skip
    return pairwise_tree_sum(parts), K.linear_partial(x, w)


@pytest.mark.parametrize("t", [3, 5, 6])
def test_whole_block_shards_are_subtrees_at_any_shard_count(t: int) -> None:
    """A shard of 2**j whole K-blocks is an aligned subtree whatever the shard count: the tree
    over 3, 5 or 6 such partials is the unsharded sum. The power-of-2 group rule is stricter
    than this; a power of 2 is needed when a shard is a slice of one block."""
    for blocks in (1, 2, 4):
        sharded, full = _shard_tree(t, blocks, seed=t * 10 + blocks)
        assert_bitwise(sharded, full, f"{t} shards of {blocks} blocks")


@pytest.mark.parametrize("t", [2, 3, 4])
def test_negative_control_three_blocks_per_shard_is_not_a_subtree(t: int) -> None:
    """3 blocks a shard: the unsharded tree pairs blocks across the shard boundary."""
    sharded, full = _shard_tree(t, 3, seed=t)
    assert n_differ(sharded, full) > 0
