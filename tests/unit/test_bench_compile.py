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
