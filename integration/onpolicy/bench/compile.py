"""Triton compile time of the exact GEMM's kernel variants, for an sm_90 target (H100/H200),
measured on this machine's CPU: Triton compiles ahead of time to PTX and a cubin with the ptxas
it ships, so no GPU is needed.

    python -m onpolicy.bench.compile [--k 2048] [--segments 1 2 4] [--out FILE]

`--out` writes the section HEADING of FILE (replaced on a re-run).

Each variant is `linear._mm_kernel` (the pointer-load GEMM: every fp32 launch, and every indexed
launch, the MoE's among them) at one of the tiles `tile_for` picks, S chained K segments: in
bf16 (tensor-core dots), and in fp32 (IEEE dots, which Triton lowers to FMA chains unrolled over
the whole tile, hence the code size) both at the tile an fp32 launch runs (`launch_tile`) and,
for comparison, at the bf16 tile uncapped. Each is compiled once into an empty cache, so the
time is the whole compile: front end, the MLIR passes, LLVM and ptxas. The TMA kernel (bf16
plain GEMMs at large M) takes tensor descriptors and is left out. Then attention's kernel at its
two tiles, fused and split, in bf16 and fp32.

Each variant is compiled as a launch at the model's shapes specializes it: pointers 16-byte
aligned and the specialized integers (strides, widths, the page size) multiples of 16. Without
that Triton knows no alignment, loads one element at a time and pipelines no load, which is
other code than a run compiles (`attention_ir` shows the difference).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from onpolicy.bench import commit, write_section

HEADING = "## Triton compile time of the kernels' variants (sm_90, compiled on the CPU)"
"""The section this benchmark owns in docs/benchmarks.md."""
TILES = ("SMALL_M", "MID_M", "LARGE_M_INDEXED", "LARGE_M_SEGMENTED_INDEXED")
"""`linear` tiles `tile_for` picks for pointer-load launches (by name)."""


def compile_variant(dtype: str, tile: tuple[int, int, int, int, int], segments: int,
                    k: int) -> tuple[float, int]:  # fmt: skip
    """(seconds, PTX characters) of one compile of `_mm_kernel` at `tile` for sm_90 into an
    empty cache."""
    from onpolicy.kernels.cuda import linear as L

    bm, bn, bk, warps, stages = tile
    fp32 = dtype == "fp32"
    ptr = "*fp32" if fp32 else "*bf16"
    sig = dict.fromkeys(L._mm_kernel.arg_names, "constexpr")
    sig |= dict.fromkeys(("x_ptr", "u_ptr", "w_ptr", "w2_ptr"), ptr)
    sig |= dict.fromkeys(("out_ptr", "out2_ptr"), "*fp32")
    sig |= dict.fromkeys(("rows_ptr", "dst_ptr", "tile_expert_ptr", "tile_start_ptr",
                          "tile_end_ptr"), "*i64")  # fmt: skip
    sig |= dict.fromkeys(("M", "N", "stride_xm", "stride_we", "stride_wn", "stride_om",
                          "n_experts"), "i32")  # fmt: skip
    seg_k = k // segments
    spec = ("N", "stride_xm", "stride_we", "stride_wn", "stride_om", "n_experts")
    const = {"GATHER": False, "SCATTER": False, "GROUPED": False, "PAIRS": False, "ROW_DIV": 1,
             "DUAL": False, "OUT_FP32": True, "SEGMENTS": segments, "SEG_K": seg_k,
             "EVEN": seg_k % bk == 0, "BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8,
             "IEEE": fp32, "SEAL": True, "SWIGLU": False}  # fmt: skip
    return _compile(L._mm_kernel, sig, const, {"num_warps": warps, "num_stages": stages}, spec)


def compile_attention(
    dtype: str,
    tile: tuple[int, int, int],
    split: bool,
    group: int = 8,
    head_dim: int = 128,
    mask_all: bool | None = None,
) -> tuple[float, int]:
    """(seconds, PTX characters) of one compile of `attention._attn_kernel` at `tile` (rows,
    warps, stages) for sm_90 into an empty cache; Qwen3-30B-A3B's GQA group and head_dim;
    `mask_all` as `attention.MASK_EVERY_BLOCK` (None: what a launch at `tile` in `dtype`
    compiles, `attention.masks_every_block`)."""
    seconds, compiled = _attention(dtype, tile, split, group, head_dim, mask_all, True)
    return seconds, len(compiled.asm["ptx"])


def attention_ir(dtype: str, tile: tuple[int, int, int], split: bool,
                 specialized: bool = True) -> str:  # fmt: skip
    """The TTGIR of attention's kernel at `tile` (Qwen3-30B-A3B's heads), as a launch
    specializes it or, with `specialized` off, knowing no alignment."""
    return _attention(dtype, tile, split, 8, 128, None, specialized)[1].asm["ttgir"]


def _attention(dtype, tile, split, group, head_dim, mask_all, specialized):
    from onpolicy.kernels.cuda import attention as A
    from onpolicy.kernels.rules import KV_BLOCK

    bm, warps, stages = tile
    ptr = "*fp32" if dtype == "fp32" else "*bf16"
    sig = dict.fromkeys(A._attn_kernel.arg_names, "constexpr")
    sig |= dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "o_ptr"), ptr)
    sig |= {"ws_ptr": "*fp32", "sched_ptr": "*i64", "pages_ptr": "*i64", "scale": "fp32"}
    ints = ("page_size", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
            "stride_vh", "stride_ot", "stride_oh")  # fmt: skip
    sig |= dict.fromkeys(("n_tiles", "stride_pages", *ints), "i32")
    const = {"G": group, "D": head_dim, "BM": bm, "BN": KV_BLOCK,
             "LOG_BN": KV_BLOCK.bit_length() - 1, "P": A.KV_PARTITION, "SPLIT": split,
             "IEEE": dtype == "fp32", "PLAIN": False,
             "MASK_ALL": A.masks_every_block(bm, dtype == "fp32") if mask_all is None
             else mask_all, "PREFETCH": A.prefetches(tile, dtype == "fp32")}  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    return _build(A._attn_kernel, sig, const, options, ints if specialized else None)


def _compile(kernel, sig: dict, const: dict, options: dict,
             ints: tuple[str, ...]) -> tuple[float, int]:  # fmt: skip
    """Compile `kernel` for sm_90 into an empty cache: (seconds, PTX characters)."""
    seconds, compiled = _build(kernel, sig, const, options, ints)
    return seconds, len(compiled.asm["ptx"])


def _build(kernel, sig: dict, const: dict, options: dict, ints: tuple[str, ...] | None):
    """(seconds, the compiled kernel) of one compile for sm_90 into an empty cache. `ints`: the
    integer arguments a launch specializes as multiples of 16, the pointers then 16-byte
    aligned (a run's launches); None: nothing known, as an unspecialized source."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    divisible = [] if ints is None else [n for n in names
                                         if sig[n].startswith("*") or n in ints]  # fmt: skip
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    with tempfile.TemporaryDirectory(prefix="onpolicy-compile-") as cache:
        saved = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            t0 = time.perf_counter()
            target = GPUTarget("cuda", 90, 32)
            compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=target,
                                      options=options)  # fmt: skip
            seconds = time.perf_counter() - t0
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    return seconds, compiled


def main(argv: list[str] | None = None) -> None:
    import torch
    import triton

    from onpolicy.kernels.cuda import linear as L

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048, help="K of the GEMM (the model's hidden)")
    ap.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", help="write (or replace) this benchmark's section in this file")
    args = ap.parse_args(argv)
    compile_variant("bf16", L.SMALL_M, 1, args.k)  # imports and Triton's own first-use costs
    rows, totals = [], {"bf16": 0.0, "uncapped": 0.0, "fp32": 0.0}
    for name in TILES:
        tile = getattr(L, name)
        fp32_tile = L.launch_tile(tile, torch.float32)
        for s in args.segments:
            tb, pb = compile_variant("bf16", tile, s, args.k)
            tu, pu = compile_variant("fp32", (*tile[:4], 1), s, args.k)
            tf, pf = compile_variant("fp32", fp32_tile, s, args.k)
            for key, seconds in (("bf16", tb), ("uncapped", tu), ("fp32", tf)):
                totals[key] += seconds
            rows.append(f"| {name} {tile} | {s} | {tb:.2f} | {pb // 1024} | {tu:.2f} | "
                        f"{pu // 1024} | {fp32_tile} | {tf:.2f} | {pf // 1024} |")  # fmt: skip
            print(rows[-1], flush=True)
    from onpolicy.kernels.cuda import attention as A

    attn = []
    for name, tile in (("DECODE", A.DECODE), ("DECODE_FEW", A.DECODE_FEW), ("PREFILL", A.PREFILL),
                       ("FP32", A.FP32)):  # fmt: skip
        for split in (False, True):
            (tb, pb), (tf, pf) = (compile_attention(dt, tile, split) for dt in ("bf16", "fp32"))
            attn.append(f"| {name} {tile} | {'split' if split else 'fused'} | {tb:.2f} | "
                        f"{pb // 1024} | {tf:.2f} | {pf // 1024} |")  # fmt: skip
            print(attn[-1], flush=True)
    text = "\n".join([
        HEADING, "",
        f"`python -m onpolicy.bench.compile`, {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"commit {commit()}, Triton {triton.__version__}, target sm_90, compiled on "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), K = {args.k}. "
        "One compile of `linear._mm_kernel` per row and dtype, each into an empty cache and "
        "specialized as a launch at the model's shapes is (pointers 16-byte aligned; strides, "
        "widths and the page size multiples of 16); tile = (BLOCK_M, BLOCK_N, BLOCK_K, warps, "
        "stages).", "",
        "| tile | S | bf16 s | bf16 PTX KiB | fp32 at this tile s | its PTX KiB | fp32 launch "
        "tile | fp32 s | fp32 PTX KiB |", "|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Total: bf16 {totals['bf16']:.1f} s; fp32 at the launch tiles {totals['fp32']:.1f} s, "
        f"at the bf16 tiles {totals['uncapped']:.1f} s.", "",
        "An fp32 dot (IEEE, no tensor cores) is an FMA chain per output that Triton unrolls over "
        "the tile, BLOCK_M x BLOCK_N x BLOCK_K / (32 x warps) FMAs a thread per K chunk, and "
        "the S segments are unrolled too (`tl.static_range`): fp32 code grows with the tile "
        "and with S, where a bf16 dot is a few tensor-core instructions. fp32 launches cap "
        f"BLOCK_N at {L.FP32_MAX_N} and BLOCK_K at {L.FP32_MAX_K} (`linear.launch_tile`; the "
        "bits do not depend on the tile).", "",
        "Attention (`attention._attn_kernel`, Qwen3-30B-A3B's heads: 8 query heads a KV head, "
        "head_dim 128), each tile `tile_for` picks, fused and split; tile = (rows, warps, "
        "stages). Its fp32 dots are FMA chains too, over head_dim and over each 64-key block; "
        "every fp32 launch runs the FP32 tile (the other rows' fp32 columns are what a forced "
        "tile compiles). A bf16 launch at a tile of at least UNMASKED_MIN_ROWS rows compiles "
        "two bodies (the key blocks before the tile's first row unmasked), the others the "
        "masked one.", "",
        "| tile | schedule | bf16 s | bf16 PTX KiB | fp32 s | fp32 PTX KiB |",
        "|---|---|---|---|---|---|", *attn,
    ])  # fmt: skip
    print(text)
    if args.out:
        write_section(Path(args.out), HEADING, text)


if __name__ == "__main__":
    main()
