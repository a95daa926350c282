"""`onpolicy.bench.compile` compiles the exact GEMM for sm_90 on this CPU (Triton's own ptxas,
no GPU): one small tile in bf16 and in fp32, whose IEEE dot Triton unrolls into FMA chains over
the whole tile, so its PTX is the larger, and smaller again at the tile an fp32 launch runs."""

from __future__ import annotations

import pytest


def test_the_gemm_compiles_for_sm90_without_a_gpu():
    import torch
    from onpolicy.bench.compile import compile_variant
    from onpolicy.kernels.cuda import linear as L

    bf16 = compile_variant("bf16", L.SMALL_M, 1, 2048)
    fp32 = compile_variant("fp32", (*L.SMALL_M[:4], 1), 1, 2048)
    capped = compile_variant("fp32", L.launch_tile(L.SMALL_M, torch.float32), 1, 2048)
    assert bf16[0] > 0 and fp32[0] > 0 and capped[0] > 0, (bf16, fp32, capped)
    assert fp32[1] > 2 * bf16[1] > 0, (bf16, fp32)
    assert 2 * capped[1] < fp32[1], (capped, fp32)


def test_attention_compiles_for_sm90_without_a_gpu():
    """Attention's kernel at the decode tile, split, in both dtypes: with one body (the masked
    one on every block) fp32's FMA chains are the larger code; the unmasked blocks' body adds
    code, and a decode launch compiles without it."""
    from onpolicy.bench.compile import compile_attention
    from onpolicy.kernels.cuda import attention as A

    bf16 = compile_attention("bf16", A.DECODE, True, mask_all=True)
    fp32 = compile_attention("fp32", A.DECODE, True, mask_all=True)
    assert bf16[0] > 0 and fp32[0] > 0, (bf16, fp32)
    assert fp32[1] > 2 * bf16[1] > 0, (bf16, fp32)
    assert compile_attention("bf16", A.DECODE, True, mask_all=False)[1] > bf16[1]
    assert compile_attention("bf16", A.DECODE, True)[1] == bf16[1]


def test_the_bench_compiles_what_a_launch_compiles():
    """Compiled as a launch specializes it (aligned pointers, strides that are multiples of
    16), attention's key and value blocks load by asynchronous copies that the pipeliner
    schedules; the control, the same source knowing no alignment, loads element by element
    and copies nothing asynchronously, other code than any run compiles."""
    from onpolicy.bench.compile import attention_ir
    from onpolicy.kernels.cuda import attention as A

    copy = "ttg.async_copy_global_to_local"
    assert attention_ir("bf16", A.DECODE, True).count(copy) >= 2
    assert copy not in attention_ir("bf16", A.DECODE, True, specialized=False)


def test_only_large_bf16_tiles_split_off_the_unmasked_blocks():
    from onpolicy.kernels.cuda import attention as A

    assert not A.masks_every_block(A.PREFILL[0], fp32=False)
    assert all(A.masks_every_block(t[0], fp32=False) for t in (A.DECODE, A.DECODE_FEW, A.FP32))
    assert A.masks_every_block(A.PREFILL[0], fp32=True)


def _launch_tiles():
    from onpolicy.kernels.cuda import linear as L
    from onpolicy.kernels.cuda import moe as M

    picked = {L.tile_for(m, n, s, tma) for m in (1, 64, 65, 512, 513, 1 << 16)
              for n in (128, 4096) for s in (1, 2) for tma in (True, False)}  # fmt: skip
    return sorted(picked | {M.SMALL_TILE})


@pytest.mark.parametrize("tile", _launch_tiles())
def test_fp32_launches_cap_the_tile_and_half_precision_keeps_it(tile):
    """Every tile `tile_for` picks (and the MoE's per-pair tile): bf16 and fp16 launches run it
    as it is; fp32 launches keep its rows and warps (a grouped launch's table is cut by the
    rows), cap its columns and chunk, and run one stage."""
    import torch
    from onpolicy.kernels.cuda import linear as L

    for half in (torch.bfloat16, torch.float16):
        assert L.launch_tile(tile, half) == tile
    bm, bn, bk, warps, stages = L.launch_tile(tile, torch.float32)
    assert (bm, warps, stages) == (tile[0], tile[3], 1), tile
    assert (bn, bk) == (min(tile[1], L.FP32_MAX_N), min(tile[2], L.FP32_MAX_K)), tile
    assert bn >= 16 and bk >= 16  # tl.dot's smallest operand


def test_the_compile_log_counts_compiles_and_cache_hits_per_label(tmp_path, monkeypatch):
    """`CompileLog` hears Triton's compiler: a compile into an empty cache is counted with its
    seconds; the same kernel again from that cache is a hit, not a compile; nothing is heard
    outside `counting`; a listener set before hears every compile too, and is put back."""
    import triton
    from onpolicy.kernels.cuda.warmup import CompileLog
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def double(x_ptr, BLOCK: triton.language.constexpr):
        i = triton.language.arange(0, BLOCK)
        triton.language.store(x_ptr + i, triton.language.load(x_ptr + i) * 2)

    def build():
        src = ASTSource(double, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 128})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    heard_before = []
    before = knobs.compilation.listener

    def earlier(**kw):
        heard_before.append(kw["cache_hit"])

    knobs.compilation.listener, log = earlier, CompileLog()
    try:
        with log.counting("first"):
            build()
        with log.counting("again"):
            build()
        assert knobs.compilation.listener is earlier
    finally:
        knobs.compilation.listener = before
    build()  # not counted
    assert heard_before == [False, True], heard_before
    first, again = log.by_label["first"], log.by_label["again"]
    assert first[0] > 0 and first[1:] == [1, 0], first
    assert again == [0.0, 0, 1], again
    assert log.total()[1:] == (1, 1)
