"""What only the CUDA backend has to show: its leaf rule for row-parallel shards, and that its
bits do not depend on the tile shape or on the pipelining (the kernel's compile-time knobs)."""

from __future__ import annotations

import pytest
import torch
from adversarial import wide
from onpolicy import kernels as K
from onpolicy.kernels.cuda import linear as L
from onpolicy.kernels.rules import MMA_LEAF

pytestmark = pytest.mark.gpu


@pytest.fixture
def tile():
    """Set the linear kernel's tile for one test, restoring the module's constants after."""
    saved = (L.BLOCK_M, L.BLOCK_N, L.NUM_WARPS, L.NUM_STAGES)

    def set_tile(bm: int, bn: int, warps: int, stages: int) -> None:
        L.BLOCK_M, L.BLOCK_N, L.NUM_WARPS, L.NUM_STAGES = bm, bn, warps, stages

    yield set_tile
    L.BLOCK_M, L.BLOCK_N, L.NUM_WARPS, L.NUM_STAGES = saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [768, 2048, 4096])
def test_tile_shape_does_not_change_the_bits(tile, dtype, k):
    x = wide(200, k, seed=k, dtype=dtype, device="cuda")
    w = wide(300, k, seed=k + 1, dtype=dtype, spread=4, device="cuda")
    ref = K.linear_partial(x, w)
    for cfg in ((128, 32, 8, 3), (128, 64, 8, 2), (64, 128, 8, 3)):
        tile(*cfg)
        assert torch.equal(K.linear_partial(x, w), ref), cfg


@pytest.mark.parametrize(("k", "tp"), [(1024, 2), (2048, 4), (4096, 8), (4096, 2)])
def test_shards_of_whole_leaves_are_exact(k, tp):
    assert K.row_parallel_exact(k, tp, "cuda")
    x = wide(33, k, seed=k + tp, dtype=torch.bfloat16, device="cuda")
    w = wide(70, k, seed=k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(K.row_parallel_linear(x, w, tp), K.linear(x, w))


@pytest.mark.parametrize(("k", "tp"), [(1024, 4), (2048, 8), (768, 2)])
def test_negative_control_shards_inside_a_leaf_differ(k, tp):
    """A shard narrower than a leaf cuts the tensor core's chained order: the rule says no,
    and the bits really differ (on CPU, where a leaf is a pairwise tree, the first two are
    exact)."""
    assert not K.row_parallel_exact(k, tp, "cuda")
    x = wide(64, k, seed=k + tp, device="cuda")
    w = wide(64, k, seed=k, device="cuda")
    assert not torch.equal(K.row_parallel_linear(x, w, tp), K.linear(x, w))
    assert K.row_parallel_exact(k, tp) == (k // tp in (256, 128))


def test_leaf_is_four_k_blocks():
    assert MMA_LEAF == 4 * K.K_BLOCK
