"""What only the CUDA backend has to show: its segment rule for row-parallel shards (each
segment one chained tensor-core accumulation); that its bits do not depend on the tile shape,
the chunk width, the pipelining or TMA loads (the kernel's launch knobs, which the GEMM picks
by M and S); that attention's tiles and two schedules (partitions merged in registers, or
split over programs and merged through a workspace) and its device-tensor path give the same
bits, while another partition width does not, and a `tl.sum` denominator (the tile test's
control) moves with the tile; and that the MoE's small-batch schedule (one tile per pair, gate
and up in one launch) gives the sorted schedule's bits, and its one-launch sort is torch's."""

from __future__ import annotations

import pytest
import torch
from adversarial import wide
from onpolicy import kernels as K
from onpolicy.bits import assert_bitwise, bitwise_equal, n_differ
from onpolicy.kernels.cuda import attention as A
from onpolicy.kernels.cuda import linear as L
from onpolicy.kernels.cuda import moe as M

pytestmark = pytest.mark.gpu


@pytest.fixture
def tile():
    """Force the linear kernel's tile (and TMA on or off) for one test, restoring both."""

    def set_tile(cfg: L.Tile, tma: bool = True) -> None:
        L.FORCE, L.TMA = cfg, tma

    yield set_tile
    L.FORCE, L.TMA = None, True


TILES = [L.TINY_M, L.SMALL_M, L.MID_M, L.LARGE_M, L.LARGE_M_SEGMENTED, L.LARGE_M_INDEXED,
         L.LARGE_M_SEGMENTED_INDEXED, M.SMALL_TILE, (128, 32, 128, 8, 3), (64, 64, 64, 8, 3),
         (32, 64, 128, 4, 4), (256, 128, 64, 8, 3)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "segments"), [(768, 1), (768, 2), (2048, 1), (4096, 2), (4096, 4)])
def test_tile_shape_does_not_change_the_bits(tile, dtype, k, segments):
    """Every tile the GEMM picks by M and S (and others), with TMA loads and with pointer
    loads, gives the same bits on the same rows: 16- and 32-row tiles (mma.sync), 64 to 256
    rows (wgmma), chunks of 64, 128 and 256; in fp32, the tiles its launches run (`launch_tile`:
    16 to 256 rows, 32 and 64 columns, chunks of 16)."""
    x = wide(200, k, seed=k, dtype=dtype, device="cuda")
    w = wide(300, k, seed=k + 1, dtype=dtype, spread=4, device="cuda")
    ref = K.linear_partial(x, w, segments=segments)
    for cfg in dict.fromkeys(L.launch_tile(t, dtype) for t in TILES):
        tma_loads = dtype != torch.float32 and cfg[2] * x.element_size() <= 128  # L._tma_fits
        for tma in (True, False) if tma_loads else (False,):
            tile(cfg, tma)
            got = K.linear_partial(x, w, segments=segments)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (cfg, tma)


def test_the_fp32_tile_cap_does_not_change_the_bits(tile, monkeypatch):
    """fp32 launches cap BLOCK_N and BLOCK_K only to compile faster: a 64 x 64 tile with
    128-wide chunks, uncapped, gives the capped launch's bits (S = 1 and 2). Control: the plain
    fp32 matmul (cuBLAS, no TF32) gives other bits in the same comparison."""
    x = wide(200, 2048, seed=9, dtype=torch.float32, device="cuda")
    w = wide(300, 2048, seed=10, dtype=torch.float32, spread=4, device="cuda")
    refs = {s: K.linear_partial(x, w, segments=s) for s in (1, 2)}
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not bitwise_equal(x @ w.T, refs[1]), "plain fp32 matmul"
    monkeypatch.setattr(L, "FP32_MAX_N", 1 << 10)
    monkeypatch.setattr(L, "FP32_MAX_K", 1 << 10)
    assert L.launch_tile(L.MID_M, torch.float32)[1:3] == L.MID_M[1:3]
    tile(L.MID_M, False)
    for s, ref in refs.items():
        assert_bitwise(K.linear_partial(x, w, segments=s), ref, f"S {s}")


def test_rows_keep_their_bits_across_the_m_switch():
    """Rows computed in a batch of each band of M (TINY_M, SMALL_M, MID_M: the decode tiles, as
    launched, by TMA) equal the same rows in a batch on each large-M tile (Qwen3-30B-A3B's
    o_proj shape, S = 1 and 2)."""
    x = wide(4096, 4096, seed=1, dtype=torch.bfloat16, device="cuda")
    w = wide(2048, 4096, seed=2, dtype=torch.bfloat16, spread=4, device="cuda")
    bands = (1, 5, L.ROW_BOUNDS[0], 40, L.ROW_BOUNDS[1], 300)
    for s in (1, 2):
        full = K.linear(x, w, segments=s)
        tiles = {L.tile_for(m, 2048, s) for m in bands}
        assert {L.TINY_M, L.SMALL_M, L.MID_M} <= tiles and L.tile_for(4096, 2048, s) not in tiles
        for m in bands:
            assert_bitwise(K.linear(x[:m], w, segments=s), full[:m], f"S {s} M {m}")


@pytest.mark.parametrize(("k", "tp", "segments"),
                         [(1024, 2, 2), (2048, 4, 4), (4096, 8, 8), (4096, 2, 4), (768, 2, 2),
                          (768, 1, 2), (768, 4, 4)])  # fmt: skip
def test_shards_of_whole_segments_are_exact(k, tp, segments):
    """tp shards of S / tp whole segments each, combined by the tree, are the unsharded S
    segments' bits (Qwen3-30B-A3B's expert K = 768 at MoE TP 2 and 4 among them)."""
    assert K.row_parallel_exact(k, tp, segments)
    x = wide(33, k, seed=k + tp, dtype=torch.bfloat16, device="cuda")
    w = wide(70, k, seed=k, dtype=torch.bfloat16, device="cuda")
    assert_bitwise(K.row_parallel_linear(x, w, tp, segments=segments),
                   K.linear(x, w, segments=segments), f"K {k} tp {tp} S {segments}")  # fmt: skip


@pytest.mark.parametrize(("k", "tp"), [(1024, 2), (2048, 4), (768, 2), (4096, 2)])
def test_negative_control_a_shard_is_not_one_segment_of_another_s(k, tp):
    """Shards computed as one segment each (S = tp) against the unsharded kernel at S = 1:
    the chained order is cut at other places, the rule says no, and the bits really differ."""
    assert not K.row_parallel_exact(k, tp, 1)
    x = wide(64, k, seed=k + tp, device="cuda")
    w = wide(64, k, seed=k, device="cuda")
    assert not torch.equal(K.row_parallel_linear(x, w, tp), K.linear(x, w))


ATTENTION_TILES = [A.DECODE, A.DECODE_FEW, A.PREFILL, (16, 2, 3), (32, 4, 3), (64, 8, 2),
                   (128, 4, 2)]  # fmt: skip


def _attention_at(
    tile: A.Tile | None, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed prefill and one paged decode of Qwen3-30B-A3B's heads, every launch at `tile`
    (None: the tiles the shapes pick)."""
    n = 1100
    q = wide(n, 32, 128, seed=6, dtype=dtype, spread=2, device="cuda")
    k = wide(n, 4, 128, seed=7, dtype=dtype, spread=2, device="cuda")
    v = wide(n, 4, 128, seed=8, dtype=dtype, spread=2, device="cuda")
    dec_q = q[[699, n - 1]]
    kp, vp = k.view(n, 1, 4, 128), v.view(n, 1, 4, 128)
    table = torch.stack([torch.arange(n, device="cuda")] * 2)
    lens = torch.tensor([700, n], device="cuda")
    cu = torch.arange(3, device="cuda")
    saved = A.FORCE
    A.FORCE = tile
    try:
        # Request 0's keys are rows 0..699 of the table, request 1's the whole sequence as one.
        return K.attention(q, k, v, [0, 700, n]), K.paged_attention(
            dec_q, kp, vp, K.PagedBatch(cu, table, lens)
        )
    finally:
        A.FORCE = saved


@pytest.mark.parametrize("cfg", ATTENTION_TILES)
def test_attention_tile_does_not_change_the_bits(cfg):
    """Each attention tile (rows per program, warps, stages) gives the default tiles' bits on
    one packed prefill and one paged decode of Qwen3-30B-A3B's heads: the denominator is the
    pairwise tree over key columns, not `tl.sum`, whose order follows the threads' layout."""
    ref, dec_ref = _attention_at(None)
    got, dec = _attention_at(cfg)
    assert_bitwise(got, ref, f"prefill {cfg}")
    assert_bitwise(dec, dec_ref, f"decode {cfg}")


def test_negative_control_a_tl_sum_denominator_moves_with_the_tile():
    """The tile test's harness with the denominator summed by `tl.sum` (the test-only
    `PLAIN_DENOMINATOR`): some tile gives other bits than the default tiles, so the tile test
    can fail, and the column tree is what it shows."""
    A.PLAIN_DENOMINATOR = True
    try:
        ref, dec_ref = _attention_at(None)
        moved = []
        for cfg in ATTENTION_TILES:
            got, dec = _attention_at(cfg)
            n = n_differ(got, ref) + n_differ(dec, dec_ref)
            moved += [(cfg, n)] if n else []
    finally:
        A.PLAIN_DENOMINATOR = False
    print(f"tl.sum denominator: tiles whose bits moved (tile, elements): {moved}")
    assert moved, "no tile moved the tl.sum denominator's bits: the tile test cannot fail"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unmasked_blocks_give_the_masked_bits(dtype):
    """The key blocks before a tile's first row skip the causal masks (forced on, as fp32 and
    decode tiles mask every block by default); the masked body on every block gives the same
    bits, prefill and decode. Control: the tile test's negative control shows the harness
    sees a moved bit."""
    try:
        A.MASK_EVERY_BLOCK = False
        ref, dec_ref = _attention_at(None, dtype)
        A.MASK_EVERY_BLOCK = True
        got, dec = _attention_at(None, dtype)
    finally:
        A.MASK_EVERY_BLOCK = None
    assert_bitwise(got, ref, "prefill")
    assert_bitwise(dec, dec_ref, "decode")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefetched_loads_give_the_one_loop_bits(dtype):
    """Key blocks loaded one block ahead (`PREFETCH`, forced on and off at the 8-warp decode
    tile, the one `prefetches` picks in bf16) give the one loop's bits, on the packed prefill
    and the paged decode. Control: the tile test's negative control shows the harness sees a
    moved bit."""
    saved = A.PREFETCH
    try:
        A.PREFETCH = False
        ref, dec_ref = _attention_at(A.DECODE_FEW, dtype)
        A.PREFETCH = True
        got, dec = _attention_at(A.DECODE_FEW, dtype)
    finally:
        A.PREFETCH = saved
    assert_bitwise(got, ref, "prefill")
    assert_bitwise(dec, dec_ref, "decode")


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
            got = K.paged_attention(q[lo:hi], kp, vp, K.PagedBatch([0, hi - lo], [table], [hi]))
            assert_bitwise(got, fused[lo:hi], f"chunk {lo}:{hi}, split below {split_below}")
    # Decode of 3 requests at once (ends 513, 1024, 1300), tables and lengths on the device.
    ends = [513, 1024, 1300]
    idx = torch.tensor([e - 1 for e in ends], device="cuda")
    cu = torch.arange(4, device="cuda")
    batch = K.PagedBatch(
        cu, table[None].expand(3, -1).contiguous(), torch.tensor(ends, device="cuda")
    )
    got = K.paged_attention(q[idx], kp, vp, batch)
    for i, e in enumerate(ends):
        alone = K.attention(q[:e], k[:e], v[:e], [0, e])[-1]
        assert_bitwise(got[i], alone, f"decode at {e} vs its own prefill")
    assert_bitwise(got[2], fused[-1], "decode at 1300")
    schedule(256, 0)
    assert not torch.equal(K.attention(q, k, v, [0, n]), fused), "256-key partitions"


def _qwen3_moe(seed: int) -> tuple[torch.Tensor, ...]:
    """Qwen3-30B-A3B's MoE in bf16 on the GPU: router, gate, up and down weights (128 experts,
    2048 -> 768 -> 2048) and 600 tokens, from `seed` on."""
    e, h, i = 128, 2048, 768
    gate = wide(e, h, seed=seed, dtype=torch.bfloat16, spread=2, device="cuda") * 2**-6
    wg, wu = (wide(e, i, h, seed=seed + 1 + j, dtype=torch.bfloat16, spread=2, device="cuda")
              * 2**-6 for j in range(2))  # fmt: skip
    wd = wide(e, h, i, seed=seed + 3, dtype=torch.bfloat16, spread=2, device="cuda") * 2**-5
    x = wide(600, h, seed=seed + 4, dtype=torch.bfloat16, spread=2, device="cuda")
    return gate, wg, wu, wd, x


@pytest.mark.parametrize("on_load", [True, False])
def test_moe_rows_equal_silu_mul_then_linear_per_expert(on_load):
    """Qwen3-30B-A3B's MoE shape in bf16: each (token, slot) of the small and the sorted
    schedule, the down projection computing SiLU-mul as it loads its rows (`on_load`) or
    reading `silu_mul`'s, gives the bits of `linear`, `silu_mul` and `linear` on that row
    alone. Control: torch's bf16 SiLU-mul (each step rounded to bf16) in the same composition
    moves some rows' bits."""
    saved = M.SWIGLU_ON_LOAD_MAX_PAIRS
    M.SWIGLU_ON_LOAD_MAX_PAIRS = 1 << 62 if on_load else 0
    try:
        _moe_rows_equal_silu_mul_then_linear()
    finally:
        M.SWIGLU_ON_LOAD_MAX_PAIRS = saved


def _moe_rows_equal_silu_mul_then_linear():
    gate, wg, wu, wd, x = _qwen3_moe(seed=16)
    ids, _ = K.moe_route(x, gate, 8)
    outs = {"sorted": K.moe_expert_outputs(x, ids, wg, wu, wd),
            "small": K.moe_expert_outputs(x[:4], ids[:4], wg, wu, wd)}  # fmt: skip
    assert ids.numel() > M.SMALL_PAIRS >= 4 * 8

    def per_expert(tok, slot, silu_mul):
        ex, row = int(ids[tok, slot]), x[tok : tok + 1]
        hid = silu_mul(K.linear(row, wg[ex]), K.linear(row, wu[ex]))
        return K.linear(hid, wd[ex])[0]

    moved = 0
    for name, out in outs.items():
        for tok in (0, 3) if name == "small" else (0, 250, 599):
            for slot in range(8):
                assert_bitwise(out[tok, slot], per_expert(tok, slot, K.silu_mul),
                               f"{name}: token {tok} slot {slot}")  # fmt: skip
                plain = per_expert(tok, slot, lambda g, u: torch.nn.functional.silu(g) * u)
                moved += not torch.equal(out[tok, slot], plain)
    assert moved, "torch's bf16 SiLU-mul gave the same bits everywhere: the test cannot fail"


def test_moe_small_batch_schedule_equals_the_sorted_one():
    """Qwen3-30B-A3B's MoE shape: tokens alone (one tile per pair, unsorted) give their bits
    in a batch of 600 (sorted by expert), also with local experts."""
    gate, wg, wu, wd, x = _qwen3_moe(seed=6)
    ids, _ = K.moe_route(x, gate, 8)
    assert ids.numel() > M.SMALL_PAIRS >= 8 * 8
    full = K.moe_expert_outputs(x, ids, wg, wu, wd)
    assert_bitwise(K.moe_expert_outputs(x[3:11], ids[3:11], wg, wu, wd), full[3:11], "8 tokens")
    local = list(range(0, 128, 3))
    part = K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=local)
    small = K.moe_expert_outputs(x[:5], ids[:5], wg, wu, wd, local_experts=local)
    assert_bitwise(small, part[:5], "5 tokens, local experts")
    mine = torch.isin(ids, torch.tensor(local, device="cuda"))[..., None]
    assert_bitwise(part, torch.where(mine, full, 0.0), "local slots are the full ones, others 0")
    two = K.moe_expert_outputs(x, ids, wg, wu, wd, segments=2)
    assert_bitwise(K.moe_expert_outputs(x[:2], ids[:2], wg, wu, wd, segments=2), two[:2], "S 2")
    assert not torch.equal(two, full), "the down projection at S = 2 is another sum"
    assert_bitwise(K.moe(x[:1], gate, wg, wu, wd, 8), K.moe(x, gate, wg, wu, wd, 8)[:1], "moe")


def test_moe_sorted_path_at_the_small_tile_keeps_the_bits(monkeypatch):
    """Qwen3-30B-A3B's MoE shape in bf16: with `SORTED_SMALL_TILE_MAX_PAIRS` at 512, 9 and 64
    tokens (72 and 512 pairs) take the sorted path at SMALL_TILE and give the bits of 600
    tokens at linear's tiles, at S = 1 and 2 and with local experts; the MoE layer at 64 tokens
    as a CUDA-graph replay on new tokens too. Control: torch's bf16 matmuls for the same rows
    give other bits."""
    gate, wg, wu, wd, x = _qwen3_moe(seed=36)
    ids, _ = K.moe_route(x, gate, 8)
    local = list(range(0, 128, 3))
    full = {s: K.moe_expert_outputs(x, ids, wg, wu, wd, segments=s) for s in (1, 2)}
    part = K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=local)
    layer = K.moe(x, gate, wg, wu, wd, 8)
    monkeypatch.setattr(M, "SORTED_SMALL_TILE_MAX_PAIRS", 512)
    assert M._sorted_tile(600 * 8, 768, 1) == L.tile_for(600 * 8, 768, tma=False)
    for t in (9, 64):
        n = t * 8
        assert M.SMALL_PAIRS < n and M._sorted_tile(n, 768, 1) == M.SMALL_TILE
        assert M.SMALL_TILE != L.tile_for(n, 768, tma=False), "the tile must change"
        for s, ref in full.items():
            got = K.moe_expert_outputs(x[:t], ids[:t], wg, wu, wd, segments=s)
            assert_bitwise(got, ref[:t], f"{t} tokens, S {s}")
        got = K.moe_expert_outputs(x[:t], ids[:t], wg, wu, wd, local_experts=local)
        assert_bitwise(got, part[:t], f"{t} tokens, local experts")
    static = x[:64].clone()
    K.moe(static, gate, wg, wu, wd, 8)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.moe(static, gate, wg, wu, wd, 8)
    static.copy_(x[64:128])
    graph.replay()
    assert_bitwise(captured, layer[64:128], "the replayed layer")
    e = ids[:4, 0]
    silu = torch.nn.functional.silu
    plain = torch.stack([(silu(x[j] @ wg[e[j]].T) * (x[j] @ wu[e[j]].T)) @ wd[e[j]].T
                         for j in range(4)])  # fmt: skip
    assert not bitwise_equal(plain, full[1][:4, 0]), "torch's bf16 matmuls"


def test_moe_schedule_in_one_launch_is_the_stable_sorts(monkeypatch):
    """Qwen3-30B-A3B's router on the GPU: the one-launch schedule (`_schedule_kernel`) gives
    `_tiles`' torch schedule entry for entry at 9, 64 and 512 tokens (72, 512 and 4096 pairs),
    with local experts too, and as a CUDA-graph replay on new ids; 300 tokens through it give
    the rows of 600 through the torch schedule. Control: the schedule of the ids with two
    pairs of different experts swapped differs."""
    gate, wg, wu, wd, x = _qwen3_moe(seed=26)
    ids, _ = K.moe_route(x, gate, 8)
    assert 9 * 8 > M.SMALL_PAIRS and 512 * 8 == M.SCHEDULE_MAX_PAIRS < 600 * 8

    def flat(schedule: tuple) -> tuple:
        order, rows, tiles = schedule
        return order, rows, *tiles

    def same(a: tuple, b: tuple) -> bool:
        return all(torch.equal(u, v) for u, v in zip(flat(a), flat(b), strict=True))

    def equal(ids: torch.Tensor, bm: int) -> bool:
        return same(M._schedule_launch(ids, 128, 8, bm), M._schedule_torch(ids, 128, 8, bm))

    for t, bm in ((9, 64), (64, 64), (512, 128)):
        pairs = ids[:t].reshape(-1)
        assert equal(pairs, bm), f"{t} tokens"
        assert equal(torch.where(pairs % 3 == 0, pairs, 128), bm), f"{t} tokens, local experts"
    static = ids[:64].reshape(-1).clone()
    graph = torch.cuda.CUDAGraph()
    M._schedule_launch(static, 128, 8, 64)  # compiled before the capture
    with torch.cuda.graph(graph):
        captured = M._schedule_launch(static, 128, 8, 64)
    static.copy_(ids[64:128].reshape(-1))
    graph.replay()
    assert same(captured, M._schedule_torch(static, 128, 8, 64)), "the replay's schedule"
    full = K.moe_expert_outputs(x, ids, wg, wu, wd)  # above SCHEDULE_MAX_PAIRS: torch's
    monkeypatch.setattr(M, "ONE_LAUNCH_SCHEDULE", True)
    assert_bitwise(K.moe_expert_outputs(x[:300], ids[:300], wg, wu, wd), full[:300], "300 tokens")
    swap = ids[:64].reshape(-1).clone()
    j = int((swap != swap[0]).nonzero()[0])
    swap[0], swap[j] = swap[j].clone(), swap[0].clone()
    launched = M._schedule_launch(ids[:64].reshape(-1), 128, 8, 64)
    assert not same(launched, M._schedule_torch(swap, 128, 8, 64)), "the control cannot fail"
