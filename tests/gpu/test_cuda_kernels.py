"""What only the CUDA backend has to show: its leaf rule for row-parallel shards; that its
bits do not depend on the tile shape or on the pipelining (the kernel's compile-time knobs,
which the GEMM picks by M); that attention's two schedules (partitions merged in registers,
or split over programs and merged through a workspace) and its device-tensor path give the
same bits, while another partition width does not; and that the MoE's small-batch schedule
(one tile per pair) gives the sorted schedule's bits."""

from __future__ import annotations

import pytest
import torch
from adversarial import wide
from onpolicy import kernels as K
from onpolicy.bits import assert_bitwise
from onpolicy.kernels.cuda import attention as A
from onpolicy.kernels.cuda import linear as L
from onpolicy.kernels.cuda import moe as M
from onpolicy.kernels.rules import MMA_LEAF

pytestmark = pytest.mark.gpu


@pytest.fixture
def tile():
    """Force the linear kernel's tile for one test, restoring the choice by M after."""

    def set_tile(bm: int, bn: int, warps: int, stages: int) -> None:
        L.FORCE = (bm, bn, warps, stages)

    yield set_tile
    L.FORCE = None


TILES = [L.SMALL_M, L.LARGE_M, M.SMALL_TILE, (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 8, 3),
         (32, 64, 4, 4)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [768, 2048, 4096])
def test_tile_shape_does_not_change_the_bits(tile, dtype, k):
    """Every tile the GEMM picks by M (and others) gives the same bits on the same rows,
    including 16- and 32-row tiles, where Triton issues mma.sync instead of wgmma."""
    x = wide(200, k, seed=k, dtype=dtype, device="cuda")
    w = wide(300, k, seed=k + 1, dtype=dtype, spread=4, device="cuda")
    ref = K.linear_partial(x, w)
    for cfg in TILES:
        tile(*cfg)
        assert torch.equal(K.linear_partial(x, w).view(torch.int32), ref.view(torch.int32)), cfg


def test_rows_keep_their_bits_across_the_m_switch():
    """A row computed in a batch on the small-M tile equals the same row in a batch on the
    large-M tile (Qwen3-30B-A3B's o_proj shape)."""
    x = wide(600, 4096, seed=1, dtype=torch.bfloat16, device="cuda")
    w = wide(2048, 4096, seed=2, dtype=torch.bfloat16, spread=4, device="cuda")
    assert L.tile_for(600, 2048) != L.tile_for(5, 2048)
    assert_bitwise(K.linear(x[:5], w), K.linear(x, w)[:5], "rows 0:5")


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


@pytest.fixture
def schedule():
    """Set attention's partition width and split threshold for one test."""
    saved = A.KV_PARTITION, A.SPLIT_BELOW

    def set_schedule(partition: int, split_below: int) -> None:
        A.KV_PARTITION, A.SPLIT_BELOW = partition, split_below

    yield set_schedule
    A.KV_PARTITION, A.SPLIT_BELOW = saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_split_and_fused_partitions_give_the_same_bits(schedule, dtype):
    """Qwen3-30B-A3B's heads (32 q, 4 kv, 128), one 1300-token sequence over three partition
    boundaries: packed prefill fused, packed prefill split, chunked prefill and decode over a
    paged cache as lists and as device tensors: one set of bits. Control: partitions of
    another width give other bits."""
    n, ps = 1300, 16
    q = wide(n, 32, 128, seed=3, dtype=dtype, spread=2, device="cuda")
    k = wide(n, 4, 128, seed=4, dtype=dtype, spread=2, device="cuda")
    v = wide(n, 4, 128, seed=5, dtype=dtype, spread=2, device="cuda")
    schedule(512, 0)
    fused = K.attention(q, k, v, [0, n])
    schedule(512, 1 << 30)
    assert_bitwise(K.attention(q, k, v, [0, n]), fused, "split prefill")
    pages = -(-n // ps)
    table = torch.randperm(pages + 7, device="cuda")[:pages]
    kp = torch.full((pages + 7, ps, 4, 128), float("nan"), dtype=dtype, device="cuda")
    vp = torch.full_like(kp, float("nan"))
    pos = torch.arange(n, device="cuda")
    kp[table[pos // ps], pos % ps], vp[table[pos // ps], pos % ps] = k, v
    for split_below in (0, 1 << 30):
        schedule(512, split_below)
        for lo, hi in ((0, 700), (700, 1100), (1100, 1299), (1299, 1300)):
            got = K.paged_attention(q[lo:hi], kp, vp, [0, hi - lo], [table], [hi])
            assert_bitwise(got, fused[lo:hi], f"chunk {lo}:{hi}, split below {split_below}")
    # Decode of 3 requests at once (ends 513, 1024, 1300), tables and lengths on the device.
    ends = [513, 1024, 1300]
    idx = torch.tensor([e - 1 for e in ends], device="cuda")
    cu = torch.arange(4, device="cuda")
    got = K.paged_attention(q[idx], kp, vp, cu, table[None].expand(3, -1).contiguous(),
                            torch.tensor(ends, device="cuda"))  # fmt: skip
    for i, e in enumerate(ends):
        alone = K.attention(q[:e], k[:e], v[:e], [0, e])[-1]
        assert_bitwise(got[i], alone, f"decode at {e} vs its own prefill")
    assert_bitwise(got[2], fused[-1], "decode at 1300")
    schedule(256, 0)
    assert not torch.equal(K.attention(q, k, v, [0, n]), fused), "256-key partitions"


def test_moe_small_batch_schedule_equals_the_sorted_one():
    """Qwen3-30B-A3B's MoE shape: tokens alone (one tile per pair, unsorted) give their bits
    in a batch of 600 (sorted by expert), also with local experts."""
    e, h, i = 128, 2048, 768
    gate = wide(e, h, seed=6, dtype=torch.bfloat16, spread=2, device="cuda") * 2**-6
    wg, wu = (wide(e, i, h, seed=7 + j, dtype=torch.bfloat16, spread=2, device="cuda") * 2**-6
              for j in range(2))  # fmt: skip
    wd = wide(e, h, i, seed=9, dtype=torch.bfloat16, spread=2, device="cuda") * 2**-5
    x = wide(600, h, seed=10, dtype=torch.bfloat16, spread=2, device="cuda")
    ids, _ = K.moe_route(x, gate, 8)
    assert ids.numel() > M.SMALL_PAIRS >= 8 * 8
    full = K.moe_expert_outputs(x, ids, wg, wu, wd)
    assert_bitwise(K.moe_expert_outputs(x[3:11], ids[3:11], wg, wu, wd), full[3:11], "8 tokens")
    local = list(range(0, 128, 3))
    part = K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=local)
    small = K.moe_expert_outputs(x[:5], ids[:5], wg, wu, wd, local_experts=local)
    assert_bitwise(small, part[:5], "5 tokens, local experts")
    assert_bitwise(K.moe(x[:1], gate, wg, wu, wd, 8), K.moe(x, gate, wg, wu, wd, 8)[:1], "moe")
