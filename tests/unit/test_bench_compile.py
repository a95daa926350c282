"""`onpolicy.bench.compile` compiles the exact GEMM for sm_90 on this CPU (Triton's own ptxas,
no GPU): one small tile in bf16 and in fp32, whose IEEE dot Triton unrolls into FMA chains over
the whole tile, so its PTX is the larger."""

from __future__ import annotations


def test_the_gemm_compiles_for_sm90_without_a_gpu():
    from onpolicy.bench.compile import compile_variant

    bf16 = compile_variant("bf16", "SMALL_M", 1, 2048)
    fp32 = compile_variant("fp32", "SMALL_M", 1, 2048)
    assert bf16[0] > 0 and fp32[0] > 0, (bf16, fp32)
    assert fp32[1] > 2 * bf16[1] > 0, (bf16, fp32)


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
