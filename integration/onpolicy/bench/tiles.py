"""Launch tiles of the exact CUDA kernels, swept at Qwen3-30B-A3B's shapes: per op and size,
each candidate tile's median time and whether its output is bitwise the default tile's. A tile
only decides which outputs a program computes, so every row must say `same`; the fastest is
what `tile_for` should pick. Baselines: cuBLAS (torch.matmul) for the GEMM, the copy bandwidth
for decode attention, flash SDPA for prefill attention.

    python -m onpolicy.bench.tiles [--only gemm,decode_gemm,dispatch,attention,partitions,moe,
                                           schedule,decode_step]
                                   [--layers 4]

`decode_step` profiles the reference model's decode step by kernel (eager, one step at B = 1
and 64, context 512, Qwen3-30B-A3B's layer dims, --layers layers) and times it as a CUDA-graph
replay: where a step's GPU time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from onpolicy import kernels as K
from onpolicy.bench.kernels import captured, decode_step
from onpolicy.kernels.cuda import attention as A
from onpolicy.kernels.cuda import linear as L
from onpolicy.kernels.cuda import moe as M
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B
from onpolicy.models.reference import Qwen3MoeReference

DTYPE = torch.bfloat16
SMALL_GEMM_TILES: tuple[L.Tile, ...] = (
    (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (16, 32, 128, 4, 4), (64, 32, 64, 4, 6),
    (64, 64, 64, 4, 5), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4),
)  # fmt: skip
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) candidates up to M = 512."""
LARGE_GEMM_TILES: tuple[L.Tile, ...] = (
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
    (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
)  # fmt: skip
"""Candidates above M = 512, each with and without TMA."""
DECODE_TILES: tuple[A.Tile, ...] = ((16, 2, 3), (16, 2, 5), (16, 4, 3), (16, 4, 5), (16, 8, 3),
                                    (16, 8, 4), (16, 8, 5), (16, 8, 6))  # fmt: skip
"""Decode candidates. A key block's loads depend on its page ids (an indirect load), so
Triton's pipeliner double-buffers K and V only from 5 stages on; at 3 or 4 a block's loads are
issued after the previous block's products and waited for at once (its TTGIR)."""
PREFILL_TILES: tuple[A.Tile, ...] = ((128, 8, 2), (128, 8, 3), (128, 8, 4), (128, 8, 5),
                                     (128, 4, 5), (64, 4, 5), (64, 4, 2))  # fmt: skip
DECODE_GEMM_TILES: tuple[L.Tile, ...] = (
    (64, 32, 128, 4, 4), (16, 32, 128, 4, 4), (16, 16, 128, 4, 4), (16, 16, 256, 4, 3),
    (16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 16, 64, 2, 6), (16, 32, 128, 2, 4),
    (32, 32, 128, 4, 4), (16, 16, 128, 1, 4),
)  # fmt: skip
"""Candidates at decode's M (1 to 64), GEMV-shaped ones among them: more programs over N."""
SMALL_MOE_TILES: tuple[L.Tile, ...] = ((16, 64, 128, 4, 4), (16, 32, 128, 4, 4),
                                       (16, 32, 64, 4, 6), (64, 32, 128, 4, 4))  # fmt: skip
SORTED_MOE_TILES: tuple[L.Tile, ...] = ((16, 64, 128, 4, 4), (16, 32, 256, 4, 3),
                                        (16, 128, 128, 4, 3), (32, 64, 128, 4, 4))  # fmt: skip
"""Candidates for the sorted MoE path when each expert holds a few rows (decode at B = 64)."""
SORTED_SMALL_TILE_CANDIDATE = 1024
"""Pairs up to which `schedule` times the sorted path at SMALL_TILE against linear's tile."""


def ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    ia, ib = (t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
              for t in (a, b))  # fmt: skip
    return "same" if torch.equal(ia, ib) else f"DIFFER {(ia != ib).sum().item()}"


@contextlib.contextmanager
def setting(module, **values) -> Iterator[None]:
    """The module's attributes set to `values` for the block (a tile forced, a schedule
    constant changed), restored after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def at_tile(tile: L.Tile, tma: bool, run: Callable[[], tuple]) -> tuple | None:
    """run() with every GEMM launched at `tile`, by TMA or by pointers; None (reported) where
    the tile does not compile (shared memory)."""
    L.TMA = tma
    try:
        with setting(L, FORCE=tile):
            return run()
    except Exception as e:
        print(f"  {tile} tma={tma}: {type(e).__name__} {str(e)[:80]}")
        return None
    finally:
        L.TMA = True


def eager(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple:
    """(the output, the median ms of an eager call) of the linear."""
    return K.linear(x, w, segments=s), ms(lambda: K.linear(x, w, segments=s))


def replayed(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple:
    """(the eager output, a CUDA-graph replay's output, the replay's median ms) of the linear."""
    out = K.linear(x, w, segments=s)
    g, y = captured(lambda: K.linear(x, w, segments=s))
    return out, y, ms(g.replay)


def gemm(dev: torch.device) -> None:
    shapes = (("qkv", 5120, 2048, 1), ("o_proj", 2048, 4096, 1), ("o_proj", 2048, 4096, 2),
              ("expert gate", 768, 2048, 1), ("expert down", 2048, 768, 1),
              ("expert down", 2048, 768, 2))  # fmt: skip
    for name, n, k, s in shapes:
        w = torch.randn(n, k, device=dev, dtype=DTYPE) * k**-0.5
        for m in (1, 64, 512, 4096, 16384):
            x = torch.randn(m, k, device=dev, dtype=DTYPE)
            ref = K.linear(x, w, segments=s)
            alone = K.linear(x[:3], w, segments=s)
            base = ms(lambda: x @ w.T)  # noqa: B023
            flop = 2 * m * n * k
            print(f"gemm {name} K={k} N={n} S={s} M={m}: cuBLAS {base:.4f} ms "
                  f"{flop / base / 1e9:.0f} TFLOP/s; default {L.tile_for(m, n, s)}; "
                  f"rows alone {same(alone, ref[:3])}")  # fmt: skip
            tiles = SMALL_GEMM_TILES if m <= 512 else LARGE_GEMM_TILES
            for tile, tma in [(t, tma) for t in tiles for tma in (True, False)]:
                if m <= 512 and not tma and tile[2] * 2 > 128:
                    continue  # TMA is not used for this tile anyway
                got = at_tile(tile, tma, partial(eager, x, w, s))
                if got is None:
                    continue
                out, t = got
                print(f"  {tile} tma={tma}: {t:.4f} ms {flop / t / 1e9:.0f} TFLOP/s "
                      f"ratio {base / t:.2f} {same(out, ref)}")  # fmt: skip


def decode_gemm(dev: torch.device) -> None:
    """The GEMMs of one decode step at M <= 64, each candidate timed as a CUDA-graph replay
    (as decode runs: the host's dispatch is not in the time), loaded by TMA (the default tile
    by pointers too)."""
    shapes = (("qkv", 5120, 2048, 1), ("o_proj", 2048, 4096, 1), ("o_proj", 2048, 4096, 2),
              ("router", 128, 2048, 1), ("lm_head", 151936, 2048, 1))  # fmt: skip
    for name, n, k, s in shapes:
        w = torch.randn(n, k, device=dev, dtype=DTYPE) * k**-0.5
        for m in (1, 8, 64):
            x = torch.randn(m, k, device=dev, dtype=DTYPE)
            ref = K.linear(x, w, segments=s)
            g, _ = captured(lambda: x @ w.T)  # noqa: B023
            base = ms(g.replay)
            print(f"decode gemm {name} K={k} N={n} S={s} M={m}: cuBLAS graph {base * 1e3:.1f} us "
                  f"{2 * n * k / base / 1e9:.2f} TB/s of weights; default "
                  f"{L.tile_for(m, n, s)}")  # fmt: skip
            for tile, tma in [(t, True) for t in DECODE_GEMM_TILES] + [(L.SMALL_M, False)]:
                got = at_tile(tile, tma, partial(replayed, x, w, s))
                if got is None:
                    continue
                out, y, t = got
                print(f"  {tile} tma={tma}: {t * 1e3:.1f} us {2 * n * k / t / 1e9:.2f} TB/s "
                      f"ratio {base / t:.2f} {same(out, ref)} graph {same(y, ref)}")  # fmt: skip


def dispatch(dev: torch.device) -> None:
    """The host's time per call of the exact linear, and of its parts, with the GPU kept busy
    (so a launch never waits on it): what the one-call interval of `bench.kernels` adds to the
    kernel at small M."""
    import time

    from triton.tools.tensor_descriptor import TensorDescriptor

    def host_us(fn: Callable[[], object], reps: int = 200) -> float:
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU work ahead of the calls
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        return t

    for name, n, k, s, m in (("qkv", 5120, 2048, 1, 1), ("qkv", 5120, 2048, 1, 4096),
                             ("o_proj", 2048, 4096, 2, 4096)):  # fmt: skip
        w = torch.randn(n, k, device=dev, dtype=DTYPE)
        x = torch.randn(m, k, device=dev, dtype=DTYPE)
        bm, bn, bk, _, _ = L.launch_tile(L.tile_for(m, n, s), x.dtype)
        parts = {
            "K.linear": lambda: K.linear(x, w, segments=s),  # noqa: B023
            "tree_mm": lambda: L.tree_mm(x, w, segments=s, out_dtype=x.dtype),  # noqa: B023
            "tile_for + launch_tile": lambda: L.launch_tile(L.tile_for(m, n, s), x.dtype),  # noqa: B023
            "2 TensorDescriptors": lambda: (TensorDescriptor.from_tensor(x, [bm, bk]),  # noqa: B023
                                            TensorDescriptor.from_tensor(w, [bn, bk])),  # noqa: B023
            "torch.empty out": lambda: torch.empty(m, n, device=dev, dtype=x.dtype),  # noqa: B023
            "torch.matmul": lambda: x @ w.T,  # noqa: B023
        }  # fmt: skip
        cells = ", ".join(f"{label} {host_us(fn):.1f}" for label, fn in parts.items())
        print(f"dispatch {name} M={m} S={s}: host us per call: {cells}", flush=True)


def copy_bw(dev: torch.device) -> float:
    src = torch.ones(1 << 30, dtype=torch.int8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (ms(lambda: dst.copy_(src)) * 1e-3)


HEADS = (32, 4, 128)
"""Qwen3-30B-A3B's attention: query heads, KV heads, head_dim."""
PAGE = 16
"""The benches' cache page size."""


def packed(dev: torch.device, n: int, seqs: int) -> tuple:
    """q, k, v [n, heads, d] and cu_seqlens of `seqs` equal sequences: a packed prefill."""
    hq, hkv, d = HEADS
    q = torch.randn(n, hq, d, device=dev, dtype=DTYPE)
    k = torch.randn(n, hkv, d, device=dev, dtype=DTYPE)
    return q, k, torch.randn_like(k), [i * n // seqs for i in range(seqs + 1)]


def paged(dev: torch.device, b: int, ctx: int) -> tuple:
    """q [b, hq, d], a shuffled paged cache (k and v pages) of `ctx` keys a request, and the
    decode batch's tensors (cu_seqlens, page tables, lengths)."""
    hq, hkv, d = HEADS
    per = ctx // PAGE
    kp = torch.randn(b * per, PAGE, hkv, d, device=dev, dtype=DTYPE)
    table = torch.randperm(b * per, device=dev).view(b, per)
    q = torch.randn(b, hq, d, device=dev, dtype=DTYPE)
    cu, lens = torch.arange(b + 1, device=dev), torch.full((b,), ctx, device=dev)
    return q, kp, torch.randn_like(kp), (cu, table, lens)


def attention(dev: torch.device) -> None:
    bw = copy_bw(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    hq, hkv, d = HEADS
    for b, ctx in ((1, 512), (1, 4096), (8, 4096), (64, 4096), (512, 4096)):
        q, kp, vp, (cu, table, lens) = paged(dev, b, ctx)

        def fresh(q=q, kp=kp, vp=vp, cu=cu, table=table, lens=lens):
            return K.paged_attention(q, kp, vp, K.PagedBatch(cu, table, lens))

        ref = fresh()
        nbytes = 2 * kp.numel() * kp.element_size()
        print(f"decode B={b} ctx={ctx}: default {A.tile_for(b * hq // hkv, b)}; each a graph "
              "of the kernels alone (the batch's schedule derived before capture)")  # fmt: skip
        for split_below in (A.SPLIT_BELOW, 4 * A.SPLIT_BELOW):
            for tile in DECODE_TILES:
                with setting(A, SPLIT_BELOW=split_below, FORCE=tile):
                    batch = K.PagedBatch(cu, table, lens)
                    K.paged_attention(q, kp, vp, batch)
                    g, out = captured(partial(K.paged_attention, q, kp, vp, batch))
                    t = ms(g.replay)
                print(f"  {tile} split<{split_below}: {t * 1e3:.1f} us "
                      f"{nbytes / t / 1e9:.2f} TB/s = {nbytes / t * 1e3 / bw:.0%} of copy "
                      f"{same(out, ref)}")  # fmt: skip
        g, _ = captured(fresh)
        t = ms(g.replay)
        print(f"  default with its schedule derived in the graph: {t * 1e3:.1f} us "
              f"{nbytes / t / 1e9:.2f} TB/s = {nbytes / t * 1e3 / bw:.0%} of copy")  # fmt: skip
    for n, seqs in ((4096, 1), (16384, 4)):
        q, k, v, cu = packed(dev, n, seqs)
        ref = K.attention(q, k, v, cu)
        qh, kh, vh = (t.view(seqs, n // seqs, -1, d).transpose(1, 2) for t in (q, k, v))

        def flash(qh=qh, kh=kh, vh=vh):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                      enable_gqa=True)  # fmt: skip

        base = ms(flash)
        print(f"prefill {seqs} x {n // seqs}: flash {base:.3f} ms; default "
              f"{A.tile_for(n * hq // hkv, seqs)}")  # fmt: skip
        for tile in PREFILL_TILES:
            with setting(A, FORCE=tile):
                out = K.attention(q, k, v, cu)
                t = ms(lambda: K.attention(q, k, v, cu))  # noqa: B023
            print(f"  {tile}: {t:.3f} ms ratio {base / t:.2f} {same(out, ref)}")


def partitions(dev: torch.device) -> None:
    """What the partition width (part of the bits: a rules change) would buy: decode at
    context 512 as a graph of the kernels alone, and packed prefill, at 128, 256 and 512 keys."""
    ctx = 512
    for b in (1, 8, 64):
        q, kp, vp, (cu, table, lens) = paged(dev, b, ctx)
        for keys in (128, 256, 512):
            with setting(A, KV_PARTITION=keys):
                batch = K.PagedBatch(cu, table, lens)
                K.paged_attention(q, kp, vp, batch)
                g, _ = captured(partial(K.paged_attention, q, kp, vp, batch))
                t = ms(g.replay)
            print(f"decode B={b} ctx={ctx}, partitions of {keys} keys: {t * 1e3:.1f} us")
    for n, seqs in ((4096, 1), (16384, 4)):
        q, k, v, cu = packed(dev, n, seqs)
        for keys in (128, 256, 512):
            with setting(A, KV_PARTITION=keys):
                K.attention(q, k, v, cu)
                t = ms(lambda: K.attention(q, k, v, cu))  # noqa: B023
            print(f"prefill {seqs} x {n // seqs}, partitions of {keys} keys: {t:.3f} ms")


def masks(dev: torch.device) -> None:
    """The masked body on every key block against the blocks before a tile's first row
    unmasked (`MASK_EVERY_BLOCK` True and False; `masks_every_block` picks per tile): packed
    prefill, and decode as a graph of the kernels alone; the bits must be the same."""
    (hq, hkv, _), ctx = HEADS, 4096
    body = {True: "masked body on every block", False: "unmasked blocks before the edge"}
    for n, seqs in ((4096, 1), (16384, 4)):
        q, k, v, cu = packed(dev, n, seqs)
        ref = K.attention(q, k, v, cu)
        default = A.masks_every_block(A.tile_for(n * hq // hkv, seqs)[0], fp32=False)
        for every in (True, False):
            with setting(A, MASK_EVERY_BLOCK=every):
                out = K.attention(q, k, v, cu)
                t = ms(lambda: K.attention(q, k, v, cu))  # noqa: B023
            print(f"prefill {seqs} x {n // seqs}, {body[every]}{' (default)' * (every == default)}"
                  f": {t:.3f} ms {same(out, ref)}")  # fmt: skip
    for b in (1, 64):
        q, kp, vp, (cu, table, lens) = paged(dev, b, ctx)
        ref = K.paged_attention(q, kp, vp, K.PagedBatch(cu, table, lens))
        default = A.masks_every_block(A.tile_for(b * hq // hkv, b)[0], fp32=False)
        for every in (True, False):
            with setting(A, MASK_EVERY_BLOCK=every):
                batch = K.PagedBatch(cu, table, lens)
                K.paged_attention(q, kp, vp, batch)
                g, out = captured(partial(K.paged_attention, q, kp, vp, batch))
                t = ms(g.replay)
            print(f"decode B={b} ctx={ctx}, {body[every]}{' (default)' * (every == default)}: "
                  f"{t * 1e3:.1f} us {same(out, ref)}")  # fmt: skip


def prefetch(dev: torch.device) -> None:
    """Decode with each key block's loads issued one block ahead against one loop
    (`PREFETCH` True and False), at the two decode tiles, as graphs of the kernels alone over
    paged caches; the bits must be the same."""
    hq, hkv, _ = HEADS
    for ctx in (512, 4096):
        for b in (1, 8, 16, 32, 48, 64, 512):
            q, kp, vp, (cu, table, lens) = paged(dev, b, ctx)
            ref = K.paged_attention(q, kp, vp, K.PagedBatch(cu, table, lens))
            default = A.tile_for(b * hq // hkv, b)
            for tile in (A.DECODE_FEW, A.DECODE):
                for on in (False, True):
                    if on and tile[1] < A.PREFETCH_MIN_WARPS:
                        continue  # spills (PREFETCH_MIN_WARPS)
                    with setting(A, FORCE=tile, PREFETCH=on):
                        batch = K.PagedBatch(cu, table, lens)
                        K.paged_attention(q, kp, vp, batch)
                        g, out = captured(partial(K.paged_attention, q, kp, vp, batch))
                        t = ms(g.replay)
                    mark = " (default tile)" * (tile == default)
                    print(f"decode B={b} ctx={ctx} {tile}{mark}, prefetch {on}: "
                          f"{t * 1e3:.1f} us {same(out, ref)}", flush=True)  # fmt: skip


def moe(dev: torch.device) -> None:
    e, h, i, top = 128, 2048, 768, 8
    gate = torch.randn(e, h, device=dev, dtype=DTYPE) * h**-0.5
    wg, wu = (torch.randn(e, i, h, device=dev, dtype=DTYPE) * h**-0.5 for _ in range(2))
    wd = torch.randn(e, h, i, device=dev, dtype=DTYPE) * i**-0.5
    for m in (1, 8):
        x = torch.randn(m, h, device=dev, dtype=DTYPE)
        ref = K.moe(x, gate, wg, wu, wd, top)
        for tile in SMALL_MOE_TILES:
            saved = M.SMALL_TILE
            M.SMALL_TILE = tile
            try:
                out = K.moe(x, gate, wg, wu, wd, top)
                eager = ms(lambda: K.moe(x, gate, wg, wu, wd, top))  # noqa: B023
                g, y = captured(lambda: K.moe(x, gate, wg, wu, wd, top))  # noqa: B023
                g.replay()
                replay = ms(g.replay)
                print(f"moe M={m} small tile {tile}: eager {eager:.3f} ms, graph "
                      f"{replay * 1e3:.1f} us {same(out, ref)} graph {same(y, ref)}")  # fmt: skip
            finally:
                M.SMALL_TILE = saved
    for m in (4096, 16384):
        x = torch.randn(m, h, device=dev, dtype=DTYPE)
        ref = K.moe(x, gate, wg, wu, wd, top)
        flop = 2 * m * top * 3 * h * i
        for tile in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                     (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)):  # fmt: skip
            with setting(L, FORCE=tile):
                out = K.moe(x, gate, wg, wu, wd, top)
                t = ms(lambda: K.moe(x, gate, wg, wu, wd, top))  # noqa: B023
            print(f"moe M={m} tile {tile}: {t:.3f} ms {flop / t / 1e9:.0f} TFLOP/s "
                  f"{same(out, ref)}")  # fmt: skip
        profile(f"moe M={m}", lambda: K.moe(x, gate, wg, wu, wd, top))  # noqa: B023
    x = torch.randn(1, h, device=dev, dtype=DTYPE)
    profile("moe M=1", lambda: K.moe(x, gate, wg, wu, wd, top))


def schedule(dev: torch.device) -> None:
    """The sorted MoE path's schedule as graph replays: one launch (`_schedule_kernel`)
    against `_tiles`' torch ops, then the MoE layer with each (`ONE_LAUNCH_SCHEDULE`); at
    decode's batches the layer with its GEMMs at SMALL_TILE (`SORTED_SMALL_TILE_MAX_PAIRS`)
    and with every launch at the sorted path's candidate tiles."""
    cfg = QWEN3_30B_A3B
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    top = cfg.num_experts_per_tok
    gate = torch.randn(e, h, device=dev, dtype=DTYPE) * 0.02
    wg, wu = (torch.randn(e, i, h, device=dev, dtype=DTYPE) * 0.02 for _ in range(2))
    wd = torch.randn(e, h, i, device=dev, dtype=DTYPE) * 0.02

    def flat(schedule, ids: torch.Tensor, bm: int) -> tuple:
        order, rows, tiles = schedule(ids, e, top, bm)
        return order, rows, *tiles

    for m in (64, 128, 512):
        x = torch.randn(m, h, device=dev, dtype=DTYPE)
        ids = K.moe_route(x, gate, top)[0].reshape(-1)
        bm = L.tile_for(ids.numel(), i, tma=False)[0]
        ref, times = flat(M._schedule_torch, ids, bm), []
        for schedule in (M._schedule_torch, M._schedule_launch):
            g, got = captured(partial(flat, schedule, ids, bm))
            g.replay()
            ok = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
            times.append(f"{ms(g.replay) * 1e3:.1f} us {'same' if ok else 'DIFFERENT'}")
        layers = []
        for one_launch in (False, True):
            with setting(M, ONE_LAUNCH_SCHEDULE=one_launch):
                g, y = captured(partial(K.moe, x, gate, wg, wu, wd, top))
                g.replay()
                layers.append((ms(g.replay) * 1e3, y))
        print(
            f"schedule, M = {m} ({ids.numel()} pairs, {bm}-row tiles): torch {times[0]}, "
            f"one launch {times[1]}; the MoE layer {layers[0][0]:.1f} us with torch's, "
            f"{layers[1][0]:.1f} us with one launch ({same(layers[1][1], layers[0][1])})"
        )
        if m * top <= SORTED_SMALL_TILE_CANDIDATE:
            with setting(M, ONE_LAUNCH_SCHEDULE=True, SORTED_SMALL_TILE_MAX_PAIRS=m * top):
                g, y = captured(partial(K.moe, x, gate, wg, wu, wd, top))
                g.replay()
                print(
                    f"  few rows, M = {m}: the MoE layer {layers[-1][0]:.1f} us at linear's "
                    f"tile, {ms(g.replay) * 1e3:.1f} us at SMALL_TILE ({same(y, layers[-1][1])})"
                )
        # A few rows an expert: the grouped GEMM's tile (BLOCK_M cuts each expert's rows).
        for tile in SORTED_MOE_TILES if m <= 128 else ():
            with setting(L, FORCE=tile):
                g, y = captured(partial(K.moe, x, gate, wg, wu, wd, top))
                g.replay()
                print(f"  the MoE layer at tile {tile}: {ms(g.replay) * 1e3:.1f} us "
                      f"{same(y, layers[0][1])}")  # fmt: skip


def profile(what: str, fn: Callable[[], object], rows: int = 14) -> None:
    """Where the GPU time of fn goes, by kernel."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"--- {what}: GPU time by kernel (5 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                    max_name_column_width=60))  # fmt: skip


def decode_steps(dev: torch.device, layers: int) -> None:
    cfg = dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=layers)
    model = Qwen3MoeReference.random(cfg, dtype=DTYPE, device=dev, seed=0)
    for n in (1, 64):
        step, _ = decode_step(model, n, 512, 16, dev)
        eager = step()
        g, out = captured(step)
        g.replay()
        t = ms(g.replay)
        print(f"decode step, {layers} layers, B = {n}: graph {t:.3f} ms "
              f"({t / layers * 1e3:.1f} us a layer with the LM head's share), replay "
              f"{same(out, eager)} as eager")  # fmt: skip
        profile(f"decode step, {layers} layers, B = {n}, eager", step, rows=30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="gemm,decode_gemm,dispatch,attention,moe,decode_step")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of decode_step")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    families = {"gemm": gemm, "decode_gemm": decode_gemm, "dispatch": dispatch,
                "attention": attention, "partitions": partitions, "masks": masks,
                "prefetch": prefetch, "moe": moe, "schedule": schedule,
                "decode_step": partial(decode_steps, layers=args.layers)}  # fmt: skip
    for name in args.only.split(","):
        families[name](dev)


if __name__ == "__main__":
    main()
