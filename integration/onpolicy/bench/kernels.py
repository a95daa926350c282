"""The exact kernels against the ops an engine runs by default, on one GPU at Qwen3-30B-A3B's
shapes (hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8 of width 768, vocab 151936,
bf16). Per op and size: the median time of ours (`onpolicy.kernels` on CUDA tensors) and of
the baseline, ratio = baseline / ours (>= 1: ours is faster), and the goal it is held to:

- linear: vs torch.matmul (cuBLAS), o_proj (K 4096 -> 2048) and fused qkv (2048 -> 5120);
  ratio >= 0.90 for M >= 4096 (smaller M reported only); TFLOP/s in the note;
- prefill attention: causal packed sequences of min(M, 4096) tokens vs SDPA per sequence on
  the flash backend (the note says which backend ran); ratio >= 0.80;
- decode attention: one new token per request, 4096 keys each in a paged cache (page 16,
  pages shuffled, the tables and lengths as device tensors); the K/V bytes read per second,
  >= 60 % of the measured copy bandwidth (and its share of 4.8 TB/s nominal); baseline:
  per-request SDPA (`kernels.native`);
- MoE layer: `K.moe` vs the per-expert torch loop (`K.native_ops()`); at M = 1 at most
  0.050 ms, at M = 16384 at least 400 TFLOP/s (issue 14), other M reported only;
- model: the reference Qwen3-MoE (all 48 layers unless --layers) prefill forward of one M-token
  sequence, and one decode forward of B requests at context 512 over the paged cache (random
  cached keys, the new keys and values written by `PagedKVCache.store` (`kernels.kv_store`;
  two `index_copy_` under the plain ops), page tables and lengths as device tensors, no
  sampling), exact vs
  the same model under `K.native_ops()` (lists); held
  to the 48-layer goals scaled to the layer count: decode at B = 1 <= 5 ms, at B = 64
  <= 20 ms, prefill of 4096 tokens <= 70 ms;
- sampler: `models.sampling.sample_rows` over B rows of the vocabulary at T = 1 vs softmax and
  `torch.multinomial`, and its noise (`kernels.uniform_noise`) vs the CPU backend's int64 torch
  ops on the same device (reported only).

Times are CUDA events around one eager call (the GPU idle and L2 flushed before each), the
median of as many reps as fit a small budget; rows marked "CUDA graph" time one replay of the
call captured once, as a decode step runs. A failing or OOM row is reported and skipped. At
the end, the goals table: each goal's row, the number reached, met or not.

    python -m onpolicy.bench.kernels [--quick] [--out docs/benchmarks.md] [--layers 48]
                                     [--commit HASH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from onpolicy import kernels as K
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B, Qwen3MoeConfig
from onpolicy.models.reference import PagedKVCache, Qwen3MoeReference, Request
from onpolicy.models.tiny import tiny

NOMINAL_HBM = 4.8e12
"""H200 HBM3e bandwidth, bytes/s, as published."""
DTYPE = torch.bfloat16


# --- what is measured -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Shapes:
    """The model shape and the sizes each family sweeps."""

    config: Qwen3MoeConfig
    """Model shape (the layer count is set by --layers)."""
    tokens: tuple[int, ...]
    """M swept by linear, prefill attention and MoE."""
    quick_tokens: tuple[int, ...]
    """M under --quick."""
    seq_len: int
    """Prefill attention packs sequences of min(M, seq_len) tokens."""
    context: int
    """Keys per request for decode attention."""
    page_size: int
    """Positions per KV-cache page."""
    batches: tuple[int, ...]
    """Requests swept by decode attention."""
    quick_batches: tuple[int, ...]
    """Requests under --quick."""
    model_tokens: tuple[int, ...]
    """Prefill lengths of the model forward."""
    model_batches: tuple[int, ...]
    """Requests of the model decode step."""
    model_context: int
    """Keys per request (the new one included) of the model decode step."""
    copy_bytes: int
    """Size of the tensor copied to measure the device's bandwidth."""


QWEN3 = Shapes(
    config=QWEN3_30B_A3B,
    tokens=(1, 8, 64, 512, 4096, 16384), quick_tokens=(1, 64, 4096), seq_len=4096,
    context=4096, page_size=16, batches=(1, 8, 64, 512), quick_batches=(1, 64, 512),
    model_tokens=(64, 512, 4096), model_batches=(1, 8, 64), model_context=512,
    copy_bytes=4 << 30,
)  # fmt: skip
TINY = Shapes(
    config=tiny(vocab_size=512, num_hidden_layers=2, max_position_embeddings=256),
    tokens=(1, 8, 64), quick_tokens=(1, 64), seq_len=32, context=64, page_size=16,
    batches=(1, 4), quick_batches=(4,), model_tokens=(8, 32), model_batches=(1, 4),
    model_context=32, copy_bytes=8 << 20,
)  # fmt: skip
"""Dry-run shapes (--tiny): the same code paths in seconds on a CPU; timings mean nothing."""


@dataclass(kw_only=True, slots=True)
class Row:
    """One op at one size."""

    op: str
    """The op and its shape."""
    m: int
    """Tokens (requests, for decode)."""
    ours_ms: float | None = None
    """Median ms of the exact op; None if it failed."""
    base_ms: float | None = None
    """Median ms of the baseline; None if it failed."""
    goal: str = ""
    """The target, e.g. 'ratio >= 0.90'; empty: reported only."""
    met: bool | None = None
    """Whether the goal was met; None without a goal or without the times it needs."""
    notes: list[str] = field(default_factory=list)
    """Throughput, the backend that ran, or what failed."""
    headline: str = ""
    """The goals table's measure this row stands for; empty: not in that table."""
    reached: str = ""
    """The number reached, in the goal's unit (for the goals table)."""

    @property
    def ratio(self) -> float | None:
        """baseline / ours: >= 1 means ours is faster."""
        if self.ours_ms is None or self.base_ms is None:
            return None
        return self.base_ms / self.ours_ms

    def hold_to_ratio(self, target: float) -> None:
        self.goal = f"ratio ≥ {target:.2f}"
        self.met = None if self.ratio is None else self.ratio >= target

    def hold_to_time(self, limit_ms: float) -> None:
        self.goal = f"≤ {limit_ms:.3g} ms"
        self.met = None if self.ours_ms is None else self.ours_ms <= limit_ms

    def markdown(self) -> str:
        def ms(t: float | None) -> str:
            return "—" if t is None else f"{t:.3f}"

        ratio = "—" if self.ratio is None else f"{self.ratio:.2f}"
        met = "" if not self.goal else {True: "yes", False: "no", None: "—"}[self.met]
        cells = [self.op, str(self.m), ms(self.ours_ms), ms(self.base_ms), ratio, self.goal, met,
                 "; ".join(self.notes)]  # fmt: skip
        return "| " + " | ".join(cells) + " |"


HEADER = (
    "| op | M | ours ms | baseline ms | ratio | goal | met | note |\n"
    "|---|---|---|---|---|---|---|---|"
)
GOALS_HEADER = "| measure | reached | goal | met |\n|---|---|---|---|"


def goals_table(rows: list[Row]) -> str:
    """The rows that stand for a goal, one line each: what was reached against the goal."""
    lines = [GOALS_HEADER]
    for r in rows:
        if r.headline:
            met = {True: "yes", False: "no", None: "—"}[r.met]
            lines.append(f"| {r.headline} | {r.reached or '—'} | {r.goal} | {met} |")
    return "\n".join(lines)


# --- timing -----------------------------------------------------------------------------------
class Timer:
    """Median ms of a thunk: CUDA events around one call, the GPU idle and L2 flushed first (on
    CPU: perf_counter); after two warm-up calls (JIT, autotune), as many reps as fit the budget,
    at least 3 and at most 100."""

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.cuda = device.type == "cuda"
        self.budget_ms = budget_s * 1e3
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def once(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        self.flush.zero_()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def __call__(self, fn: Callable[[], object]) -> float:
        self.once(fn)
        first = self.once(fn)
        reps = int(min(100, max(3, self.budget_ms / max(first, 1e-3))))
        return statistics.median(self.once(fn) for _ in range(reps))

    def attempt(self, fn: Callable[[], object], row: Row, who: str) -> float | None:
        """The time, or None with the failure noted in the row (the run goes on)."""
        try:
            return self(fn)
        except Exception as e:  # one failing op must not lose the rest
            row.notes.append(f"{who}: {_failure(e)}")
            return None


def _failure(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "OOM"
    print(f"--- {type(e).__name__} (continuing):", file=sys.stderr)
    traceback.print_exception(e, file=sys.stderr)
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def natively(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with every kernels op resolved to `kernels.native` (the engine default)."""

    def run():
        with K.native_ops():
            return fn()

    return run


@dataclass(kw_only=True, slots=True)
class Bench:
    """What every family needs: shapes, sizes, device, timer."""

    shapes: Shapes
    """Model shape and sweeps."""
    device: torch.device
    """Where everything runs."""
    timer: Timer
    """Times one thunk."""
    quick: bool
    """Fewer sizes."""
    copy_bw: float = math.nan
    """Measured device-to-device copy bandwidth, bytes/s (read + write)."""

    @property
    def cfg(self) -> Qwen3MoeConfig:
        return self.shapes.config

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.shapes.quick_tokens if self.quick else self.shapes.tokens

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(shape, device=self.device, dtype=DTYPE)
        return t if scale == 1.0 else t.mul_(scale)

    def measure(self, row: Row, ours: Callable[[], object], base: Callable[[], object],
                graph: bool = False) -> Row:  # fmt: skip
        """Time ours and the baseline; with `graph`, ours is captured once and each timing is
        one replay (as a decode step runs)."""
        if graph:
            replay, _ = captured(ours)
            ours = replay.replay
        row.ours_ms = self.timer.attempt(ours, row, "ours")
        row.base_ms = self.timer.attempt(base, row, "baseline")
        return row


def guarded(row: Row, fill: Callable[[Row], object]) -> Row:
    """`fill(row)` (setup and timings); a failure in the setup is noted, not raised."""
    try:
        fill(row)
    except Exception as e:
        row.notes.append(_failure(e))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def copy_bandwidth(b: Bench) -> float:
    """Bytes/s of `dst.copy_(src)` on a copy_bytes bf16 tensor, counting read + write."""
    src = torch.ones(b.shapes.copy_bytes // 2, dtype=DTYPE, device=b.device)
    dst = torch.empty_like(src)
    ms = b.timer(lambda: dst.copy_(src))
    return 2 * b.shapes.copy_bytes / (ms * 1e-3)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def _git_head() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def tflops(flop: float, ms: float | None) -> str:
    return "—" if ms is None else f"{flop / (ms * 1e-3) / 1e12:.1f}"


# --- a. linear --------------------------------------------------------------------------------
def bench_linear(b: Bench) -> Iterator[Row]:
    """o_proj at S = 1 (both sides cut K alike, or one rank's shard) and S = 2 (an unsharded
    side against a TP 2 side: two chained segments); qkv's K is never cut (S = 1)."""
    c = b.cfg
    q_width = c.num_attention_heads * c.head_dim
    qkv = q_width + 2 * c.num_key_value_heads * c.head_dim
    shapes = (
        ("o_proj", c.hidden_size, q_width, 1),
        ("o_proj", c.hidden_size, q_width, 2),
        ("qkv", qkv, c.hidden_size, 1),
    )
    for name, n, k, s in shapes:
        w = b.randn(n, k, scale=k**-0.5)
        for m in b.tokens:
            row = Row(op=f"linear {name} {k}→{n}, S = {s}", m=m)
            yield guarded(row, partial(_linear, b, w, s))


def _linear(b: Bench, w: torch.Tensor, segments: int, row: Row) -> None:
    x = b.randn(row.m, w.shape[1])
    b.measure(row, lambda: K.linear(x, w, segments=segments), lambda: torch.matmul(x, w.T))
    flop = 2 * row.m * w.numel()
    row.notes.append(f"TFLOP/s ours {tflops(flop, row.ours_ms)}, "
                     f"matmul {tflops(flop, row.base_ms)}")  # fmt: skip
    if row.m >= 4096:
        row.hold_to_ratio(0.90)
        row.headline = f"{row.op}, M = {row.m}, vs cuBLAS"
        if row.ratio is not None:
            row.reached = f"{row.ratio:.2f} ({tflops(flop, row.ours_ms)} TFLOP/s)"


# --- b. prefill attention ---------------------------------------------------------------------
def bench_prefill_attention(b: Bench) -> Iterator[Row]:
    for m in b.tokens:
        if m > 1:
            op = f"prefill attention, seqs of {min(m, b.shapes.seq_len)}"
            yield guarded(Row(op=op, m=m), partial(_prefill_attention, b))


def _sdpa_baseline(q, k, v, cu: list[int]) -> tuple[str, Callable[[], object]]:
    """Per-sequence causal SDPA on the first of flash (GQA), flash (kv repeated), default that
    runs; the per-sequence [1, H, L, D] copies are made outside the timing."""
    g = q.shape[1] // k.shape[1]
    spans = list(zip(cu[:-1], cu[1:], strict=True))

    def heads_first(t: torch.Tensor, a: int, c: int) -> torch.Tensor:
        return t[a:c].transpose(0, 1)[None].contiguous()

    gqa = [tuple(heads_first(t, a, c) for t in (q, k, v)) for a, c in spans]
    repeated = [(qs, ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)) for qs, ks, vs in gqa]
    flash = partial(sdpa_kernel, [SDPBackend.FLASH_ATTENTION])
    for name, backend, seqs, enable_gqa in (
        ("flash", flash, gqa, True),
        ("flash, kv repeated", flash, repeated, False),
        ("default backend", contextlib.nullcontext, gqa, True),
    ):

        def run(backend=backend, seqs=seqs, enable_gqa=enable_gqa):
            with backend():
                return [F.scaled_dot_product_attention(*s, is_causal=True, enable_gqa=enable_gqa)
                        for s in seqs]  # fmt: skip

        try:
            run()
        except RuntimeError:
            continue
        return name, run
    raise RuntimeError("no SDPA backend ran")


def _prefill_attention(b: Bench, row: Row) -> None:
    c, m = b.cfg, row.m
    q = b.randn(m, c.num_attention_heads, c.head_dim)
    k, v = (b.randn(m, c.num_key_value_heads, c.head_dim) for _ in range(2))
    cu = [*range(0, m, min(m, b.shapes.seq_len)), m]
    backend, baseline = _sdpa_baseline(q, k, v, cu)
    b.measure(row, lambda: K.attention(q, k, v, cu), baseline)
    causal_pairs = sum(n * (n + 1) // 2 for n in (e - a for a, e in zip(cu, cu[1:], strict=False)))
    flop = 4 * causal_pairs * c.num_attention_heads * c.head_dim
    row.notes.append(f"SDPA: {backend}; TFLOP/s ours {tflops(flop, row.ours_ms)}, "
                     f"SDPA {tflops(flop, row.base_ms)}")  # fmt: skip
    row.hold_to_ratio(0.80)
    if m >= b.shapes.seq_len:
        row.headline = f"prefill attention, {m} tokens in sequences of {cu[1]}, vs {backend}"
        row.reached = "—" if row.ratio is None else f"{row.ratio:.2f}"


# --- c. decode attention ----------------------------------------------------------------------
def bench_decode_attention(b: Bench) -> Iterator[Row]:
    batches = b.shapes.quick_batches if b.quick else b.shapes.batches
    for n in batches:
        row = Row(op=f"decode attention, {b.shapes.context} keys, paged", m=n)
        yield guarded(row, partial(_decode_attention, b, False))
        if b.device.type == "cuda":
            row = Row(op=f"decode attention, {b.shapes.context} keys, paged, CUDA graph", m=n)
            yield guarded(row, partial(_decode_attention, b, True))


def _decode_attention(b: Bench, graph: bool, row: Row) -> None:
    """With `graph`, ours is the call captured once and replayed, as a decode step runs (its
    schedule is built on the device; eager, the host's launches dominate small batches)."""
    c, s, n = b.cfg, b.shapes, row.m
    per_req = s.context // s.page_size
    k_pages, v_pages = (b.randn(n * per_req, s.page_size, c.num_key_value_heads, c.head_dim)
                        for _ in range(2))  # fmt: skip
    table = torch.randperm(n * per_req, device=b.device).view(n, per_req)
    q = b.randn(n, c.num_attention_heads, c.head_dim)
    cu, kv_lens = list(range(n + 1)), [s.context] * n
    on_device = (torch.tensor(cu, device=b.device), table, torch.tensor(kv_lens, device=b.device))

    def attend():
        return K.paged_attention(q, k_pages, v_pages, K.PagedBatch(*on_device))

    def baseline():
        return K.paged_attention(q, k_pages, v_pages, K.PagedBatch(cu, list(table), kv_lens))

    b.measure(row, attend, natively(baseline), graph)
    row.goal = "≥ 60% copy BW"
    if row.ours_ms is not None:
        bw = 2 * k_pages.numel() * k_pages.element_size() / (row.ours_ms * 1e-3)
        row.met = bw >= 0.60 * b.copy_bw
        row.notes.append(f"ours {bw / 1e12:.2f} TB/s = {bw / b.copy_bw:.0%} of copy BW, "
                         f"{bw / NOMINAL_HBM:.0%} of 4.8 TB/s")  # fmt: skip
        if graph and n >= 64:
            row.headline = f"decode attention, {s.context} keys, B = {n}, CUDA graph"
            row.reached = f"{bw / b.copy_bw:.0%} of copy BW ({bw / 1e12:.2f} TB/s)"
    if not graph or n < 64:
        row.goal, row.met = "", None


# --- d. MoE -----------------------------------------------------------------------------------
def bench_moe(b: Bench) -> Iterator[Row]:
    c = b.cfg
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    weights = (b.randn(e, h, scale=h**-0.5), b.randn(e, i, h, scale=h**-0.5),
               b.randn(e, i, h, scale=h**-0.5), b.randn(e, h, i, scale=i**-0.5))  # fmt: skip
    for m in b.tokens:
        op = f"MoE {e} experts top-{c.num_experts_per_tok}, {h}→{i}"
        yield guarded(Row(op=op, m=m), partial(_moe, b, weights, False))
        if m <= 64 and b.device.type == "cuda":
            yield guarded(Row(op=f"{op}, CUDA graph", m=m), partial(_moe, b, weights, True))


def _moe(b: Bench, weights: tuple[torch.Tensor, ...], graph: bool, row: Row) -> None:
    """With `graph` (decode-sized batches), ours is the layer captured once and replayed, as
    a decode step runs; eager, the host's launches dominate at M = 1."""
    c = b.cfg
    x = b.randn(row.m, c.hidden_size)

    def layer():
        return K.moe(x, *weights, c.num_experts_per_tok, c.norm_topk_prob)

    b.measure(row, layer, natively(layer), graph)
    flop = 2 * row.m * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    row.notes.append(f"TFLOP/s ours {tflops(flop, row.ours_ms)}, "
                     f"per-expert loop {tflops(flop, row.base_ms)}")  # fmt: skip
    if row.m == 1 and graph:
        row.hold_to_time(0.050)
        row.headline = "MoE layer, M = 1, CUDA graph"
        row.reached = "—" if row.ours_ms is None else f"{row.ours_ms * 1e3:.1f} µs"
    elif row.m >= 16384 and row.ours_ms is not None:
        row.goal = "≥ 400 TFLOP/s"
        row.met = flop / (row.ours_ms * 1e-3) >= 400e12
        row.headline = f"MoE layer, M = {row.m}"
        row.reached = f"{tflops(flop, row.ours_ms)} TFLOP/s"


# --- e. the reference model -------------------------------------------------------------------
def bench_model(b: Bench) -> Iterator[Row]:
    c = b.cfg
    model = Qwen3MoeReference.random(c, dtype=DTYPE, device=b.device, seed=0)
    layers = f"{c.num_hidden_layers} layer{'s' if c.num_hidden_layers > 1 else ''}"
    for m in b.shapes.model_tokens:
        yield guarded(Row(op=f"model prefill forward, {layers}", m=m), partial(_prefill, b, model))
    for n in b.shapes.model_batches:
        op = f"model decode step, {layers}, context {b.shapes.model_context}"
        yield guarded(Row(op=op, m=n), partial(_decode_step, b, model, False))
        if b.device.type == "cuda":
            row = Row(op=f"{op}, CUDA graph", m=n)
            yield guarded(row, partial(_decode_step, b, model, True))


def _prefill(b: Bench, model: Qwen3MoeReference, row: Row) -> None:
    tokens = torch.randint(b.cfg.vocab_size, (row.m,), device=b.device)
    positions = torch.arange(row.m, device=b.device)

    def forward():
        return model(tokens, positions, lambda i, q, k, v: K.attention(q, k, v, [0, row.m]))

    b.measure(row, forward, natively(forward))
    if row.m == 4096:
        row.hold_to_time(70.0 * b.cfg.num_hidden_layers / 48)
        row.headline = f"{row.op}, {row.m} tokens"
        row.reached = "—" if row.ours_ms is None else f"{row.ours_ms:.1f} ms"


def captured(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` captured in a CUDA graph after two warm-up calls on a side stream (compiles,
    allocator), and the output tensor each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


Step = Callable[[], torch.Tensor]


def decode_step(model: Qwen3MoeReference, n: int, ctx: int, page_size: int,
                device: torch.device) -> tuple[Step, Step]:  # fmt: skip
    """One decode step of n requests, one token each at position ctx - 1, over a paged cache of
    random earlier keys: (the step with its tables on the device, as a graph replays it; the
    same step with host tables, for the plain ops)."""
    c = model.cfg
    cache = PagedKVCache(c, model.dtype, page_size=page_size, num_pages=n * -(-ctx // page_size),
                         device=device)  # fmt: skip
    cache.free = torch.randperm(len(cache.free)).tolist()
    cache.k.normal_()
    cache.v.normal_()
    reqs = [Request(rid=r, prompt=[0] * ctx) for r in range(n)]
    for r in reqs:
        cache.reserve(r, ctx)
    tables = [cache.page_table(r) for r in reqs]
    slots = torch.cat([cache.slots(r, ctx - 1, 1) for r in reqs])
    cu, kv_lens = list(range(n + 1)), [ctx] * n
    on_device = (torch.tensor(cu, device=device), torch.stack(tables).to(device),
                 torch.tensor(kv_lens, device=device))  # fmt: skip
    tokens = torch.randint(c.vocab_size, (n,), device=device)
    positions = torch.full((n,), ctx - 1, device=device)

    def attend(batch: K.PagedBatch, layer: int, q, k, v):
        cache.store(layer, slots, k, v)
        return K.paged_attention(q, cache.k[layer], cache.v[layer], batch)

    # A new batch each step, as an engine builds one each forward: its schedule is derived
    # inside the step (and so inside a captured graph), at the first layer.
    def step():
        return model(tokens, positions, partial(attend, K.PagedBatch(*on_device)))

    def baseline():
        return model(tokens, positions, partial(attend, K.PagedBatch(cu, tables, kv_lens)))

    return step, baseline


def _decode_step(b: Bench, model: Qwen3MoeReference, graph: bool, row: Row) -> None:
    """One token per request at position context - 1, over a cache of random earlier keys;
    with `graph`, ours is the step captured once and replayed (the note says whether a replay
    gave the eager step's bits)."""
    n = row.m
    step, baseline = decode_step(model, n, b.shapes.model_context, b.shapes.page_size, b.device)
    if graph:
        eager = step()
        replay, out = captured(step)
        replay.replay()
        torch.cuda.synchronize()
        same = torch.equal(out.view(torch.int16), eager.view(torch.int16))
        row.notes.append(f"replay == eager step: {'bitwise' if same else 'NO'}")
        b.measure(row, replay.replay, natively(baseline))
        del replay
    else:
        b.measure(row, step, natively(baseline))
    row.hold_to_time({1: 5.0, 64: 20.0}.get(n, math.nan) * b.cfg.num_hidden_layers / 48)
    if n not in (1, 64):
        row.goal, row.met = "", None
    elif graph:
        row.headline = f"{row.op}, B = {n}"
        row.reached = "—" if row.ours_ms is None else f"{row.ours_ms:.1f} ms"


# --- f. the sampler ---------------------------------------------------------------------------
def bench_sampler(b: Bench) -> Iterator[Row]:
    batches = b.shapes.quick_batches if b.quick else b.shapes.batches
    for n in batches:
        row = Row(op=f"sampler, vocab {b.cfg.vocab_size}, T = 1", m=n)
        yield guarded(row, partial(_sampler, b))
        row = Row(op=f"sampler's noise, vocab {b.cfg.vocab_size}", m=n)
        yield guarded(row, partial(_noise, b))


def _sampler(b: Bench, row: Row) -> None:
    """The exact rule (`models.sampling.sample_rows`: the noise keys hashed on the host, the
    noise, the log-softmax, argmax and token log-probs on the device) against a plain sampler
    (softmax, `torch.multinomial`, the log-prob gathered from torch's log_softmax)."""
    from onpolicy.models.sampling import noise_key, sample_rows

    n = row.m
    logits = b.randn(n, b.cfg.vocab_size, scale=4.0)

    def ours():
        keys = [noise_key(7, 0, 100 + i) for i in range(n)]
        return sample_rows(logits, [1.0] * n, keys)

    def baseline():
        tokens = torch.multinomial(torch.softmax(logits.float(), -1), 1)
        return tokens, torch.log_softmax(logits.float(), -1).gather(-1, tokens)

    b.measure(row, ours, baseline)


def _noise(b: Bench, row: Row) -> None:
    """`kernels.uniform_noise` against the CPU backend's int64 torch ops run on the same device
    (the same bits)."""
    from onpolicy.kernels.cpu.noise import uniform_noise as torch_ops

    words = torch.randint(0, 2**32, (row.m, 2), dtype=torch.int64, device=b.device)
    b.measure(row, lambda: K.uniform_noise(words, b.cfg.vocab_size),
              lambda: torch_ops(words, b.cfg.vocab_size))  # fmt: skip


# --- the run ----------------------------------------------------------------------------------
FAMILIES = {
    "linear": bench_linear,
    "prefill": bench_prefill_attention,
    "decode": bench_decode_attention,
    "moe": bench_moe,
    "model": bench_model,
    "sampler": bench_sampler,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m onpolicy.bench.kernels", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="fewer sizes (M in 1, 64, 4096)")
    ap.add_argument("--out", help="append a dated markdown section with the table to this file")
    ap.add_argument("--layers", type=int, help="decoder layers of the model rows (default: all)")
    ap.add_argument("--only", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                    help="run these families only")  # fmt: skip
    dry = "cpu: with --tiny, a dry run of the plumbing (its times mean nothing)"
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=dry)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, for `--device cpu --tiny`")
    ap.add_argument("--commit", help="the code's commit, for the header (default: git's HEAD)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("onpolicy.bench.kernels needs a CUDA GPU (torch.cuda.is_available() is "
                         "False); `--device cpu --tiny` only dry-runs the plumbing")  # fmt: skip
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("onpolicy.bench.kernels: --device cpu is a dry run; add --tiny")

    shapes = TINY if args.tiny else QWEN3
    if args.layers:
        shapes = replace(shapes, config=replace(shapes.config, num_hidden_layers=args.layers))
    device = torch.device(args.device)
    timer = Timer(device, budget_s=0.05 if args.tiny else 0.3 if args.quick else 0.6)
    b = Bench(shapes=shapes, device=device, timer=timer, quick=args.quick)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.no_grad():
        b.copy_bw = copy_bandwidth(b)
        name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
        head = [
            f"## Exact kernels vs baselines, {datetime.datetime.now(datetime.UTC):%Y-%m-%d}, "
            f"{name or 'cpu'}",
            "",
            f"torch {torch.__version__}, triton {_triton_version()}; copy bandwidth "
            f"{b.copy_bw / 1e12:.2f} TB/s (read + write, {shapes.copy_bytes >> 20} MiB bf16); "
            f"commit {args.commit or _git_head()}; "
            f"`python -m onpolicy.bench.kernels {' '.join(argv or sys.argv[1:])}`",
            "",
            HEADER,
        ]
        print("\n".join(head), flush=True)
        rows: list[Row] = []
        for family in args.only:
            try:
                for row in FAMILIES[family](b):
                    rows.append(row)
                    print(row.markdown(), flush=True)
            except Exception as e:  # e.g. the model does not fit: go on
                rows.append(Row(op=family, m=0, notes=[_failure(e)]))
                print(rows[-1].markdown(), flush=True)
    goals = [r for r in rows if r.goal]
    summary = goals_table(rows)
    tail = (f"\n{sum(r.met is True for r in goals)} of {len(goals)} goals met; "
            f"{time.perf_counter() - started:.0f} s.\n\nThe goals:\n\n{summary}")  # fmt: skip
    print(tail)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + "\n".join([*head, *(r.markdown() for r in rows)]) + "\n" + tail + "\n")


if __name__ == "__main__":
    main()
