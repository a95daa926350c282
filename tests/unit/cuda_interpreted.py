"""The CUDA backend's Triton kernels run by Triton's interpreter on CPU tensors, so CI checks
their logic without a GPU: the leaf tree of the GEMM, the masks and paging of attention, the
grouped MoE schedule, the per-row kernels.

Run as a script with TRITON_INTERPRET=1 set before Triton is imported (the test does this in a
subprocess, so it never leaks into a GPU run); prints one line per check, `name ok` or
`name FAIL detail`, then `END <number of checks>`.

Every `tl.dot` is `interpreter_dot.fma_chain` (installed below, and checked first): one
correctly rounded fp32 fma per k from the accumulator, so an element's bits depend on its own
row, column and accumulator alone, never on the machine's BLAS. The invariances are therefore
compared bit for bit. The comparisons with the CPU backend (different arithmetic) put both
backends against a float64 reference, element by element, within a rounding-error bound
derived from each op's steps; u = 2^-24 and gamma(n) = n u / (1 - n u) (Higham, ch. 3).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import interpreter_dot  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from onpolicy.bits import assert_bitwise, bitwise_equal, n_differ  # noqa: E402
from onpolicy.kernels.compose import PagedBatch, combine, scale_logits  # noqa: E402
from onpolicy.kernels.cpu import attention as cpu_attention  # noqa: E402
from onpolicy.kernels.cpu import linear as cpu_linear  # noqa: E402
from onpolicy.kernels.cpu import logprob as cpu_logprob  # noqa: E402
from onpolicy.kernels.cpu import moe as cpu_moe  # noqa: E402
from onpolicy.kernels.cpu import noise as cpu_noise  # noqa: E402
from onpolicy.kernels.cpu import norm as cpu_norm  # noqa: E402
from onpolicy.kernels.cpu import ops as cpu_ops  # noqa: E402
from onpolicy.kernels.cpu import rope as cpu_rope  # noqa: E402
from onpolicy.kernels.cuda import attention, elementwise, linear, logprob, moe, noise  # noqa: E402
from onpolicy.kernels.cuda import ops as cuda_ops  # noqa: E402
from onpolicy.kernels.rules import K_BLOCK, KV_BLOCK, row_parallel_exact  # noqa: E402
from onpolicy.kernels.tree import pairwise_tree_sum  # noqa: E402

interpreter_dot.install()

U = 2.0**-24
"""Unit roundoff of fp32."""
U64 = 2.0**-53
LIBM = 8 * U
"""Relative error of fp32 exp and log: 4 ulps (an ulp is at most 2u relative). numpy documents
at most 2.52 ulps for its SIMD fp32 exp and 3.83 for log; torch's are within 1 ulp."""
TINY = 2.0**-126
"""Absolute slack for roundings that land among fp32 subnormals."""
UNDERFLOW = -87.0
"""Below this, fp32 exp is subnormal or zero: such a term may lose all its digits."""

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def gamma(n: int | torch.Tensor, u: float = U):
    return n * u / (1 - n * u)


def wide(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def outside(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Where |got - ref| > bound (NaN counts as outside)."""
    return ~((got.double() - ref).abs() <= bound)


def within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    bad = outside(got, ref, bound)
    if bad.any():
        i = tuple(int(j) for j in torch.nonzero(bad)[0])
        err = float((got.double() - ref).abs()[i])
        where = f"first at {i}: |err| {err:.3e} > {float(bound[i]):.3e}"
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outside bounds; {where}")


def differ(a: torch.Tensor, b: torch.Tensor, what: str) -> int:
    """Negative control: a and b must not be bitwise equal; returns how many elements differ."""
    assert not bitwise_equal(a, b), f"{what}: the control gives the same bits"
    return n_differ(a, b)


def dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|fl(x . w) - x . w| <= gamma(K) sum_k |x_k w_k| for any summation order, fused or not;
    the float64 reference adds gamma_64(K) times the same."""
    k = x.shape[-1]
    return (gamma(k) + gamma(k, U64)) * (x.double().abs() @ w.double().abs().T) + TINY


def chained(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """One segment of the kernel: the K_BLOCK chunks of [lo, hi) chained into one fp32
    accumulator from zero, each chunk one fixed-order dot."""
    c = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for j in range(lo, hi, K_BLOCK):
        c = interpreter_dot.fma_chain(
            x[:, j : j + K_BLOCK].numpy(), w[:, j : j + K_BLOCK].T.numpy(), c
        )
    return torch.from_numpy(c)


@triton.jit
def _dot_probe(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    at = i[:, None] * N + i[None, :]
    out = tl.dot(
        tl.load(a_ptr + at), tl.load(b_ptr + at), tl.load(c_ptr + at), input_precision="ieee"
    )
    tl.store(out_ptr + at, out)


@check
def interpreter_dot_is_the_fixed_fma_chain() -> None:
    """Diagonal element i of a 16 x 16 dot is a case with a known answer:
    0: acc 2^24 plus sixteen products of 1: each fma ties back to 2^24 (acc first, rounded
       per step); np.matmul + acc gives 2^24 + 16 in any order (a sum of small integers);
    1: products 2^24, 1 (x14), -2^24 from 0: ascending k gives 0 (descending 14, exact 14);
    2: (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24, exact only if the product is not rounded first;
    3: (1 + 2^-23) + 2^-24 (1 + 2^-18)(1 - 2^-18) = 1 + 2^-23 rounded once (rounding to
       float64 first lands on a tie that goes to 1 + 2^-22).
    The rest of the tile is wide random data, compared with `fma_chain` element by element."""
    n = 16
    a, b, c = wide(n, n, seed=20), wide(n, n, seed=21), wide(n, n, seed=22)
    a[:4], b[:, :4] = 0.0, 0.0
    a[0], b[:, 0], c[0, 0] = 1.0, 1.0, 2.0**24
    a[1], b[:, 1], c[1, 1] = 1.0, 1.0, 0.0
    a[1, 0], a[1, n - 1] = 2.0**24, -(2.0**24)
    a[2, 0], b[0, 2], c[2, 2] = 1 + 2**-12, 1 + 2**-12, -1.0
    a[3, 0], b[0, 3], c[3, 3] = 2**-24 * (1 + 2**-18), 1 - 2**-18, 1 + 2**-23
    known = torch.tensor([2.0**24, 0.0, 2**-11 + 2**-24, 1 + 2**-23])
    assert interpreter_dot.installed(), "the interpreter's dot is not interpreter_dot.create_dot"
    out = torch.empty(n, n)
    _dot_probe[(1,)](a, b, c, out, N=n)
    assert_bitwise(out.diagonal()[:4], known, "known cases")
    chain = interpreter_dot.fma_chain(a.numpy(), b.numpy(), c.numpy())
    assert_bitwise(out, torch.from_numpy(chain), "tile vs fma_chain")
    stock = interpreter_dot.stock_dot(a.numpy(), b.numpy(), c.numpy())
    assert float(stock[0, 0]) == 2.0**24 + 16, f"np.matmul + acc gave {float(stock[0, 0])}"


@check
def gemm_segments_sum_by_the_pairwise_tree() -> None:
    """One 64 x 64 tile: each of the S segments is its chunks chained into one accumulator
    from zero, and the segments are added by `pairwise_tree_sum`; S = 1 is one chain over all
    of K. Controls: the segments left to right, and one segment's chunks summed by a tree
    instead of chained."""
    for segments, width in ((1, 512), (2, 256), (3, 128), (5, 128), (6, 256), (7, 128),
                            (8, 128), (11, 128)):  # fmt: skip
        k = segments * width
        x, w = wide(64, k, seed=segments), randn(64, k, seed=100 + segments)
        got = linear.tree_mm(x, w, segments=segments)
        parts = [chained(x, w, j * width, (j + 1) * width) for j in range(segments)]
        assert_bitwise(got, pairwise_tree_sum(parts), f"{segments} segments vs the tree")
        if segments >= 5:
            differ(got, sum(parts[1:], parts[0]), f"{segments} segments left to right")
        if segments == 1:
            chunks = [chained(x, w, j, j + K_BLOCK) for j in range(0, k, K_BLOCK)]
            differ(got, pairwise_tree_sum(chunks), "one segment's chunks by the tree")


@check
def gemm_rows_are_independent_of_the_batch() -> None:
    """Rows alone and a slice at another offset give the batch's bits; both backends are
    within the dot bound of the float64 product, and a product missing its last K-block is
    not (the bound has teeth)."""
    x, w = wide(100, 1100, seed=1), wide(70, 1100, seed=2)
    full = linear.linear(x, w)
    for i in (0, 63, 64, 99):
        assert_bitwise(linear.linear(x[i : i + 1], w)[0], full[i], f"row {i}")
    assert_bitwise(linear.linear(x[37:70], w), full[37:70], "rows 37:70")
    ref, bound = x.double() @ w.double().T, dot_bound(x, w)
    within(full, ref, bound, "cuda")
    within(cpu_linear.linear(x, w), ref, bound, "cpu")
    short = linear.linear(x[:, :-K_BLOCK], w[:, :-K_BLOCK])
    assert outside(short, ref, bound).any(), "a product missing a K-block is within the bound"


@check
def gemm_shards_of_whole_segments_are_exact() -> None:
    """K = 768 (Qwen3-30B-A3B's expert width) in S = 4 segments: TP shards of whole segments
    (tp 1, 2, 4) keep the S = 4 bits; tp 2 with S = 2 gives another sum (the S = 2 bits, also
    exact against S = 2 unsharded), and TP shards that split a segment are refused."""
    k, s = 768, 4
    x, w = wide(9, k, seed=3), wide(20, k, seed=4)
    full = linear.linear(x, w, segments=s)
    for tp in (1, 2, 4):
        assert row_parallel_exact(k, tp, s), tp
        assert_bitwise(cuda_ops.row_parallel_linear(x, w, tp, segments=s), full, f"tp {tp}")
    assert not row_parallel_exact(k, 8, s)
    two = cuda_ops.row_parallel_linear(x, w, 2, segments=2)
    assert_bitwise(two, linear.linear(x, w, segments=2), "tp 2 of S = 2")
    differ(two, full, "S = 2 vs S = 4")
    differ(linear.linear(x, w), full, "S = 1 vs S = 4")
    try:
        cuda_ops.row_parallel_linear(x, w, 8, segments=s)
    except ValueError as e:
        assert "split its 4 segments" in str(e), e
    else:
        raise AssertionError("tp 8 of 4 segments was not refused")


def attention_ref(q, k, v, scale):
    """One causal sequence in float64, and the error bound of an fp32 online softmax.

    With s = scale q.k, P = softmax(s), o = P v, a computed key weight is P_j (1 + t_j) up to
    a common factor, |log(1 + t_j)| <= theta_j, the sum of: the score's dot and scaling,
    ds_j = gamma(D) scale sum_d |q_d k_jd| + u |s_j|; the shift s_j - m and the running maxima
    (each at most u (m - s_j + 2 max ds), the maxima by telescoping); one exp per block and
    per rescale (LIBM + u each, nb + 1 of them for nb key blocks). A weight below UNDERFLOW
    may vanish: relative error 1, and 1 / (1 - their P) on the sums. Then
    |o_hat - o| <= e^(2 theta_max) / (1 - gamma(L)) [sum_j P_j (e^theta_j - 1) |v_j - o|
    + gamma(L) (sum_j P_j |v_j| + |o|)] + u |o|, L = 64 nb + 2 nb + 2 roundings per sum
    (fma chains or p*v then a tree, plus the rescales)."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    q64 = q.double().transpose(0, 1)
    k64 = k.double().repeat_interleave(g, 1).transpose(0, 1)
    v64 = v.double().repeat_interleave(g, 1).transpose(0, 1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    s = torch.where(causal, q64 @ k64.transpose(1, 2) * scale, -math.inf)
    absdot = (q64.abs() @ k64.abs().transpose(1, 2)) * abs(scale)
    p = torch.softmax(s, -1)
    o = p @ v64
    m = s.amax(-1, keepdim=True)
    ds = torch.where(causal, gamma(d) * absdot + U * s.abs() + gamma(d, U64) * absdot, 0.0)
    nb = (torch.arange(n, dtype=torch.float64) // KV_BLOCK + 1)[None, :, None]
    kept = causal & (s - m >= UNDERFLOW)
    theta = ds + 2 * U * (m - s + 2 * ds.amax(-1, keepdim=True)) + (nb + 1) * (LIBM + U)
    theta = torch.where(kept, theta, 0.0)
    grow = torch.where(kept, torch.expm1(theta), causal.double())
    gl = gamma(KV_BLOCK * nb + 2 * nb + 2)
    dev = (v64[:, None, :, :] - o[:, :, None, :]).abs()  # [H, i, j, D]
    first = (p * grow)[..., None].mul(dev).sum(2)
    mag = p @ v64.abs() + o.abs()
    tmax = theta.amax(-1, keepdim=True)
    lost = torch.where(kept, 0.0, p).sum(-1, keepdim=True)
    bound = torch.exp(2 * tmax) / (1 - gl) / (1 - lost) * (first + gl * mag) + U * o.abs()
    bound = bound + 2.0**-40 * mag + TINY
    return o.transpose(0, 1), bound.transpose(0, 1)


@check
def attention_decode_and_chunks_equal_packed_prefill() -> None:
    """Chunked prefill and decode over scrambled, NaN-filled pages give packed prefill's bits;
    both backends are within the online-softmax bound, a 1% change of scale is not."""
    hq, hkv, d, n, page = 4, 2, 16, 150, 8
    q, k, v = wide(n, hq, d, seed=5), randn(n, hkv, d, seed=50), randn(n, hkv, d, seed=51)
    full = attention.attention(q, k, v, [0, n])
    scale = 1 / math.sqrt(d)
    ref, bound = attention_ref(q, k, v, scale)
    within(full, ref, bound, "cuda")
    within(cpu_attention.attention(q, k, v, [0, n]), ref, bound, "cpu")
    off = attention.attention(q, k, v, [0, n], scale=scale * 1.01)
    assert outside(off, ref, bound).any(), "a 1% wrong scale is within the bound"
    pages = -(-n // page)
    table = torch.randperm(pages + 5, generator=torch.Generator().manual_seed(52))[:pages]
    kp = torch.full((pages + 5, page, hkv, d), float("nan"))
    vp = torch.full((pages + 5, page, hkv, d), float("nan"))
    pos = torch.arange(n)
    kp[table[pos // page], pos % page], vp[table[pos // page], pos % page] = k, v
    # Partitions of 64 keys (one block) so that 150 keys cross two partition boundaries:
    # packed prefill merges them in registers (fused), chunks and decode through the
    # workspace (split); both must give the same bits. Control: 128-key partitions differ.
    saved = attention.KV_PARTITION, attention.SPLIT_BELOW
    try:
        attention.KV_PARTITION, attention.SPLIT_BELOW = 64, 0
        full = attention.attention(q, k, v, [0, n])
        attention.SPLIT_BELOW = 1 << 30
        for chunk in (1, 7, 64, 150):
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                batch = PagedBatch([0, hi - lo], [table], [hi])
                got = attention.paged_attention(q[lo:hi], kp, vp, batch)
                assert_bitwise(got, full[lo:hi], f"chunk {chunk} at {lo}")
        attention.KV_PARTITION = 128
        differ(attention.attention(q, k, v, [0, n]), full, "128-key partitions")
    finally:
        attention.KV_PARTITION, attention.SPLIT_BELOW = saved


@check
def a_paged_batch_derives_its_schedule_once() -> None:
    """The layers of one forward share a PagedBatch: the first call derives the launch
    schedule, the next layers (other pages) reuse it and give a fresh batch's bits, and a new
    tile derives its own. Control: lengths changed after the first call are not re-read (the
    kept schedule is what runs), so the later call differs from a fresh batch's."""
    hq, hkv, d, page = 4, 2, 16, 8
    kp, vp = (randn(12, page, hkv, d, seed=s) for s in (53, 54))
    kp2, vp2 = (randn(12, page, hkv, d, seed=s) for s in (55, 56))
    q = randn(6, hq, d, seed=57)
    tables = [torch.tensor([3, 0, 7]), torch.tensor([1, 2, 5, 4, 6])]
    batch = PagedBatch([0, 5, 6], tables, [20, 33])
    attention.paged_attention(q, kp, vp, batch)
    assert len(batch.derived) == 1, batch.derived.keys()
    plan = next(iter(batch.derived.values()))
    got = attention.paged_attention(q, kp2, vp2, batch)  # the next layer
    assert next(iter(batch.derived.values())) is plan and len(batch.derived) == 1
    assert_bitwise(
        got,
        attention.paged_attention(q, kp2, vp2, PagedBatch([0, 5, 6], tables, [20, 33])),
        "layer 2",
    )
    saved = attention.FORCE
    try:
        attention.FORCE = (32, 4, 2)
        assert_bitwise(attention.paged_attention(q, kp2, vp2, batch), got, "another tile")
        assert len(batch.derived) == 2, "a new tile reused another tile's schedule"
    finally:
        attention.FORCE = saved
    batch.kv_lens[1] = 30  # not re-read: the schedule kept from the first call runs
    differ(
        attention.paged_attention(q, kp2, vp2, batch),
        attention.paged_attention(q, kp2, vp2, PagedBatch([0, 5, 6], tables, [20, 30])),
        "lengths changed after the schedule was derived",
    )


@check
def packed_sequences_do_not_see_each_other() -> None:
    """A sequence packed between two others gives its bits alone; control: the same rows as
    one sequence (seeing the first five tokens) differ."""
    q, k, v = wide(80, 4, 16, seed=6), randn(80, 2, 16, seed=60), randn(80, 2, 16, seed=61)
    packed = attention.attention(q, k, v, [0, 5, 75, 80])
    alone = attention.attention(q[5:75], k[5:75], v[5:75], [0, 70])
    assert_bitwise(packed[5:75], alone, "packed vs alone")
    merged = attention.attention(q, k, v, [0, 75, 80])
    differ(merged[5:75], alone, "one sequence over the first 75 tokens")


def nan_pages(k: torch.Tensor, v: torch.Tensor, page: int, seed: int):
    """(table, k pages, v pages): k and v [T, Hkv, D] copied into shuffled pages of a 20-page
    cache whose other slots are NaN, so a load past a request's keys would show."""
    t = k.shape[0]
    table = torch.randperm(20, generator=torch.Generator().manual_seed(seed))[: -(-t // page)]
    kp = torch.full((20, page, *k.shape[1:]), float("nan"))
    vp = torch.full((20, page, *v.shape[1:]), float("nan"))
    pos = torch.arange(t)
    kp[table[pos // page], pos % page], vp[table[pos // page], pos % page] = k, v
    return table, kp, vp


@check
def unmasked_blocks_give_the_masked_bits() -> None:
    """Blocks wholly before a tile's first row skip the causal masks: every launch (packed
    prefill of three sequences, fused and split, at two tiles; decode over pages) gives the
    bits of the masked body run on every block (`MASK_EVERY_BLOCK`). Control: one key of an
    unmasked block changed moves the output."""
    q, k, v = wide(300, 4, 16, seed=7), randn(300, 2, 16, seed=70), randn(300, 2, 16, seed=71)
    cu = [0, 130, 135, 300]
    page = 16
    table, kp, vp = nan_pages(k, v, page, seed=72)

    def launches():
        out = []
        for tile in ((16, 4, 2), (64, 4, 2)):
            for split_below in (0, 1 << 30):
                attention.FORCE, attention.SPLIT_BELOW = tile, split_below
                out.append(attention.attention(q, k, v, cu))
                batch = PagedBatch([0, 1, 31], [table, table], [170, 300])
                out.append(attention.paged_attention(q[[169, *range(270, 300)]], kp, vp, batch))
        return out

    saved = attention.FORCE, attention.SPLIT_BELOW, attention.KV_PARTITION
    try:
        attention.KV_PARTITION = 128
        attention.MASK_EVERY_BLOCK = False  # fp32 takes the masked body everywhere by default
        fast = launches()
        attention.MASK_EVERY_BLOCK = True
        masked = launches()
        for i, (a, b) in enumerate(zip(fast, masked, strict=True)):
            assert_bitwise(a, b, f"launch {i}")
        attention.MASK_EVERY_BLOCK = False
        k[140, 0, 3] += 1.0
        differ(launches()[0][135:300], fast[0][135:300], "key 140 changed")
    finally:
        attention.FORCE, attention.SPLIT_BELOW, attention.KV_PARTITION = saved
        attention.MASK_EVERY_BLOCK = None


@check
def prefetched_loads_give_the_one_loop_bits() -> None:
    """Loads issued one block ahead (`PREFETCH`) give the one loop's bits: decode and chunked
    prefill over pages (unused slots NaN, so a load past a request's keys would show), packed
    prefill, fused and split over 128-key partitions. Control: a key of a partition's last
    block changed moves the output."""
    q, k, v = randn(300, 4, 16, seed=8), randn(300, 2, 16, seed=80), randn(300, 2, 16, seed=81)
    page = 16
    table, kp, vp = nan_pages(k, v, page, seed=82)

    def launches():
        out = []
        for split_below in (0, 1 << 30):
            attention.SPLIT_BELOW = split_below
            out.append(attention.attention(q, k, v, [0, 130, 135, 300]))
            batch = PagedBatch([0, 1, 2, 33], [table, table, table], [1, 200, 300])
            out.append(attention.paged_attention(q[[0, 199, *range(269, 300)]], kp, vp, batch))
        return out

    saved = attention.FORCE, attention.SPLIT_BELOW, attention.KV_PARTITION, attention.PREFETCH
    try:
        attention.FORCE, attention.KV_PARTITION = (16, 8, 2), 128
        attention.PREFETCH = False
        plain = launches()
        attention.PREFETCH = True
        ahead = launches()
        for i, (a, b) in enumerate(zip(ahead, plain, strict=True)):
            assert_bitwise(a, b, f"launch {i}")
        k[127, 1, 5] += 1.0
        kp[table[127 // page], 127 % page] = k[127]
        differ(launches()[1][1], ahead[1][1], "key 127 changed")
    finally:
        attention.FORCE, attention.SPLIT_BELOW, attention.KV_PARTITION, attention.PREFETCH = saved


def swiglu_ref(x, ids, wg, wu, wd):
    """(out [T, k, H], bound) in float64 for each (token, slot)'s expert, x fp32.
    gate, up: dot bounds Bg, Bu. h = silu(g) up in fp32 (exp, +1, /, *): with |silu'| <= 1.1
    and |silu''| <= 0.5, |dh| <= (1.1 Bg + 0.5 Bg^2)(|up| + Bu) + |silu(g)| Bu
    + (LIBM + 3u)(|h| + that); where g may be below UNDERFLOW, silu(g) may become 0: + |h|.
    out = h . wd: gamma(I) sum |h||wd| + sum |dh||wd|, plus the reference's gamma_64."""
    x64 = x.double()[:, None, :, None]
    ex = ids.long()
    wg64, wu64, wd64 = wg.double()[ex], wu.double()[ex], wd.double()[ex]  # [T, k, ., .]
    g, up = (wg64 @ x64)[..., 0], (wu64 @ x64)[..., 0]
    h_dim, i_dim = x.shape[-1], wg.shape[1]
    gh = gamma(h_dim) + gamma(h_dim, U64)
    bg, bu = gh * (wg64.abs() @ x64.abs())[..., 0], gh * (wu64.abs() @ x64.abs())[..., 0]
    silu = g * torch.sigmoid(g)
    h = silu * up
    prop = (1.1 * bg + 0.5 * bg**2) * (up.abs() + bu) + silu.abs() * bu
    dh = prop + (LIBM + 3 * U) * (h.abs() + prop) + TINY
    dh = torch.where(g - bg < UNDERFLOW, dh + h.abs(), dh)
    out = (wd64 @ h[..., None])[..., 0]
    bound = (gamma(i_dim) + gamma(i_dim, U64)) * (wd64.abs() @ h.abs()[..., None])[..., 0]
    bound = bound + (wd64.abs() @ dh[..., None])[..., 0] + TINY
    return out, bound


@check
def moe_grouped_rows_equal_linear_per_expert() -> None:
    """Each (token, slot) of the grouped GEMM gives the bits of `linear` on that row alone, at
    linear's tile and at SMALL_TILE (`SORTED_SMALL_TILE_MAX_PAIRS`); local experts select
    rows; both backends' router logits and expert outputs are within their bounds, and tokens
    whose routing is decided by more than the bounds get the float64 reference's experts on
    both."""
    e, h, i, t, top = 8, 256, 64, 40, 2
    # A small gate keeps the router's probabilities normal fp32 numbers: no ties at zero.
    x, gate = wide(t, h, seed=7), randn(e, h, seed=70) * 2.0**-8
    wg, wu, wd = (
        randn(*s, seed=71 + j) * 0.1 for j, s in enumerate([(e, i, h), (e, i, h), (e, h, i)])
    )
    ids, weights = moe.route(x, gate, top)
    out = moe.expert_outputs(x, ids, wg, wu, wd)
    saved = moe.SORTED_SMALL_TILE_MAX_PAIRS
    try:  # the sorted path at SMALL_TILE, not linear's tile: the same rows
        moe.SORTED_SMALL_TILE_MAX_PAIRS = t * top
        tile = linear.tile_for(t * top, i, tma=False)
        assert moe._sorted_tile(t * top, i, 1) == moe.SMALL_TILE != tile, tile
        assert_bitwise(moe.expert_outputs(x, ids, wg, wu, wd), out, "the sorted path at SMALL_TILE")
    finally:
        moe.SORTED_SMALL_TILE_MAX_PAIRS = saved
    for tok in (0, 17, 39):
        for s in range(top):
            ex = int(ids[tok, s])
            row = x[tok : tok + 1]
            hid = elementwise.silu_mul(linear.linear(row, wg[ex]), linear.linear(row, wu[ex]))
            assert_bitwise(out[tok, s], linear.linear(hid, wd[ex])[0], f"token {tok} slot {s}")
    local = moe.expert_outputs(x, ids, wg, wu, wd, local_experts=[1, 4])
    mask = torch.isin(ids, torch.tensor([1, 4]))
    assert mask.any() and (~mask).any(), "the local experts hold all slots or none"
    assert_bitwise(local[mask], out[mask], "local experts' slots")
    assert_bitwise(local[~mask], torch.zeros_like(local[~mask]), "other slots")
    # A range is compared, any other set gathered from a mask: the same slots either way.
    ranged = moe.expert_outputs(x, ids, wg, wu, wd, local_experts=range(2, 6))
    mask = (ids >= 2) & (ids < 6)
    assert mask.any() and (~mask).any(), "the local range holds all slots or none"
    assert_bitwise(ranged[mask], out[mask], "local range's slots")
    assert_bitwise(ranged[~mask], torch.zeros_like(ranged[~mask]), "slots outside the range")
    assert t * top > moe.SMALL_PAIRS >= 6 * top, "both schedules must run"
    small = moe.expert_outputs(x[9:15], ids[9:15], wg, wu, wd)  # one tile per pair, unsorted
    assert_bitwise(small, out[9:15], "small batch vs the sorted schedule")
    small = moe.expert_outputs(x[9:15], ids[9:15], wg, wu, wd, local_experts=[1, 4])
    assert_bitwise(small, local[9:15], "small batch, local experts")
    assert_bitwise(cuda_ops.moe(x, gate, wg, wu, wd, top), combine(out, ids, weights), "moe")

    logits64, lb = x.double() @ gate.double().T, dot_bound(x, gate)
    within(linear.linear(x, gate), logits64, lb, "cuda router logits")
    within(cpu_linear.linear(x, gate), logits64, lb, "cpu router logits")
    srt, order = logits64.sort(-1, descending=True)
    bs = lb.gather(-1, order)
    gap_ok = (srt[:, :top] - srt[:, 1 : top + 1] > 2 * (bs[:, :top] + bs[:, 1 : top + 1])
              + 2.0**-16 * (1 + srt[:, :top].abs() + srt[:, 1 : top + 1].abs()))  # fmt: skip
    decided = gap_ok.all(-1) & (srt[:, 0] - srt[:, top - 1] < -UNDERFLOW)
    assert 2 * decided.sum() >= t, f"only {int(decided.sum())} of {t} tokens' routing decided"
    cpu_ids, _ = cpu_moe.route(x, gate, top)
    assert_bitwise(ids[decided], order[decided, :top], "cuda routing of decided tokens")
    assert_bitwise(cpu_ids[decided], order[decided, :top], "cpu routing of decided tokens")

    ref, bound = swiglu_ref(x, ids, wg, wu, wd)
    within(out, ref, bound, "cuda expert outputs")
    within(cpu_moe.expert_outputs(x, ids, wg, wu, wd), ref, bound, "cpu expert outputs")


@check
def moe_schedule_is_the_stable_sorts() -> None:
    """The one-launch schedule (`_schedule_kernel`) gives `_tiles`' torch schedule, entry for
    entry: the stable sort of the pairs by expert, each sorted pair's row of x, and every tile
    slot's expert, start and end, for batches with few or many rows an expert, non-local
    pairs (id num_experts) and none local, up to SCHEDULE_MAX_PAIRS; with ONE_LAUNCH_SCHEDULE
    the expert outputs keep their bits. Control: the same comparison against the schedule of
    the ids with two pairs of different experts swapped fails."""
    g = torch.Generator().manual_seed(11)
    cases = [(65, 128, 8, 64, 128), (70, 4, 2, 64, 1), (512, 128, 8, 64, 3),
             (moe.SCHEDULE_MAX_PAIRS, 128, 8, 128, 129), (100, 8, 2, 16, 9),
             (333, 16, 1, 32, 16)]  # fmt: skip

    def equal(a: tuple, b: tuple) -> bool:
        (oa, ra, ta), (ob, rb, tb) = a, b
        return all(torch.equal(x, y) for x, y in zip((oa, ra, *ta), (ob, rb, *tb), strict=True))

    for n, experts, k, bm, spread in cases:
        ids = torch.randint(0, spread, (n,), generator=g).clamp(max=experts)
        if spread == 1:
            ids = torch.full((n,), experts)  # every pair non-local: no tile has an expert
        launched = moe._schedule_launch(ids, experts, k, bm)
        where = f"{n} pairs, {experts} experts, k {k}, {bm}-row tiles"
        assert equal(launched, moe._schedule_torch(ids, experts, k, bm)), where
    swap = ids.clone()
    i, j = 0, int((ids != ids[0]).nonzero()[0])
    swap[i], swap[j] = ids[j], ids[i]
    assert not equal(launched, moe._schedule_torch(swap, experts, k, bm)), "it cannot fail"
    x, w = wide(40, 64, seed=12), [randn(8, *s, seed=13 + j) * 0.1 for j, s in
                                   enumerate([(32, 64), (32, 64), (64, 32)])]  # fmt: skip
    ids = torch.randint(0, 8, (40, 2), generator=g)
    assert ids.numel() > moe.SMALL_PAIRS, "the sorted path must run"
    outputs, saved = {}, moe.ONE_LAUNCH_SCHEDULE
    try:
        for one_launch in (False, True):
            moe.ONE_LAUNCH_SCHEDULE = one_launch
            outputs[one_launch] = moe.expert_outputs(x, ids, *w, local_experts=[0, 3, 5])
    finally:
        moe.ONE_LAUNCH_SCHEDULE = saved
    assert_bitwise(outputs[True], outputs[False], "expert outputs through the one-launch schedule")


@check
def row_kernels_are_row_independent_and_match_the_cpu_backend() -> None:
    """RMSNorm: a row alone gives the batch's bits, the fused residual sum is one fp32 add
    (the CPU backend's bits); y = w x / sqrt(mean(x^2) + eps) is within
    (gamma(H) / 2 + 6u)(1 + 2^-10) |y| (a sum of squares: relative gamma(H); / H, + eps,
    eps in fp32, sqrt (half the relative error, + u), 1 / ., x *, w *: u each). RoPE:
    x1 c - x2 s within gamma(2)(|x1 c| + |x2 s|) of float64 from the same fp32 table.
    Embedding: a copy."""
    x, r, wn = wide(7, 3, 96, seed=8), wide(7, 3, 96, seed=9), randn(96, seed=80)
    normed, res = elementwise.rms_norm(x, wn, 1e-6, r)
    alone, _ = elementwise.rms_norm(x[4], wn, 1e-6, r[4])
    assert_bitwise(normed[4], alone, "row 4 alone")
    cpu_normed, cpu_res = cpu_norm.rms_norm(x, wn, 1e-6, r)
    assert_bitwise(res, cpu_res, "residual sum")
    assert_bitwise(res, x + r, "residual sum is one fp32 add")
    h = res.double()
    y = wn.double() * h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    bound = (gamma(96) / 2 + 6 * U) * (1 + 2.0**-10) * y.abs() + TINY
    within(normed, y, bound, "cuda rms_norm")
    within(cpu_normed, y, bound, "cpu rms_norm")

    table = cpu_rope.rope_table(16, 1e6, 64)
    q, p = wide(5, 3, 16, seed=10), torch.tensor([0, 9, 63, 2, 9])
    cs = table[p][:, None, :].double()
    cos, sin = cs[..., :8], cs[..., 8:]
    x1, x2 = q[..., :8].double(), q[..., 8:].double()
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    mag = torch.cat([(x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()], -1)
    bound = gamma(2) * mag + TINY
    within(elementwise.rope(q, p, table), ref, bound, "cuda rope")
    within(cpu_rope.rope(q, p, table), ref, bound, "cpu rope")

    ids, emb = torch.tensor([3, 0, 49]), randn(50, 33, seed=81)
    assert_bitwise(elementwise.embedding(ids, emb), emb[ids], "embedding")


def logprob_ref(xs: torch.Tensor, tok: torch.Tensor):
    """log_softmax(xs)[tok] in float64 for fp32 logits xs (already divided by the temperature:
    both backends share that rounding), and its bound. e_j = exp(xs_j - M): relative
    t_j <= u (M - xs_j) + LIBM (below UNDERFLOW e_j may vanish: 1); S = sum e_j, positive
    terms: relative rho <= gamma(V) + sum_j P_j (e^t_j - 1); then log (LIBM |log S|),
    M + log S (u), the subtraction (u): |d lp| <= rho / (1 - rho) + LIBM |log S| + u |lse|
    + u |lp|."""
    x = xs.double()
    m = x.amax(-1, keepdim=True)
    lse = torch.logsumexp(x, -1)
    p = torch.exp(x - lse[:, None])
    grow = torch.where(x - m < UNDERFLOW, 1.0, torch.expm1(U * (m - x) + LIBM))
    rho = gamma(x.shape[-1]) + (p * grow).sum(-1)
    lp = x.gather(-1, tok[:, None].long())[:, 0] - lse
    log_s = lse - m[:, 0]
    bound = rho / (1 - rho) + LIBM * log_s.abs() + U * lse.abs() + U * lp.abs()
    return lp, bound * (1 + 2.0**-10) + 2.0**-40 * (1 + lse.abs()) + TINY


@check
def logprobs_vocab_parallel_equal_full() -> None:
    """Vocab-parallel log-probs at TP 2, 4, 8 give the full row's bits, TP 16 (shards inside
    a segment) is refused; both backends are within the log-softmax bound."""
    logits, tok = (
        wide(6, 4096, seed=11),
        torch.randint(0, 4096, (6,), generator=torch.Generator().manual_seed(90)),
    )
    full = logprob.token_logprobs(logits, tok, 0.7)
    ref, bound = logprob_ref(scale_logits(logits, 0.7), tok)
    within(full, ref, bound, "cuda")
    within(cpu_logprob.token_logprobs(logits, tok, 0.7), ref, bound, "cpu")
    for tp in (2, 4, 8):
        shards = list(logits.chunk(tp, -1))
        assert_bitwise(logprob.vocab_parallel_token_logprobs(shards, tok, 0.7), full, f"tp {tp}")
    try:
        logprob.vocab_parallel_token_logprobs(list(logits.chunk(16, -1)), tok, 0.7)
    except ValueError:
        pass
    else:
        raise AssertionError("tp 16 cuts segments but was not refused")


@check
def noise_is_the_cpu_backends_bits() -> None:
    """The uint32 kernel gives the CPU backend's int64 bits, keys of every size (the word 0,
    2^32 - 1, the rest random) and a vocabulary that does not fill its last block; control: the
    other multiplier order gives other bits."""
    g = torch.Generator().manual_seed(5)
    words = torch.randint(0, 2**32, (5, 2), generator=g, dtype=torch.int64)
    words[0] = torch.tensor([0, 2**32 - 1])
    got = noise.uniform_noise(words, 3001)
    assert_bitwise(got, cpu_noise.uniform_noise(words, 3001), "noise")
    assert 0.0 < got.min().item() and got.max().item() < 1.0
    saved = cpu_noise.MIX
    cpu_noise.MIX = saved[::-1]
    try:
        differ(got, cpu_noise.uniform_noise(words, 3001), "noise with the multipliers swapped")
    finally:
        cpu_noise.MIX = saved


@check
def qk_norm_rope_is_norm_then_rope() -> None:
    """The fused kernel reads q and k in place from one qkv row (head dims 16 and 8: strides
    that are and are not multiples of 16) and gives `rope(rms_norm(.))`'s bits for each; the
    CPU backend's op is its own two ops. Control: k normed with q's weight gives other bits."""
    for d, hq, hkv in ((16, 4, 2), (8, 6, 1)):
        table = cpu_rope.rope_table(d, 1e6, 64).to(torch.bfloat16).float()
        qkv = wide(5, (hq + 2 * hkv) * d, seed=d).to(torch.bfloat16)
        q, k, _ = qkv.view(5, -1, d).split([hq, hkv, hkv], dim=1)
        qw, kw, p = randn(d, seed=d + 1), randn(d, seed=d + 2), torch.tensor([0, 9, 63, 2, 9])
        qw, kw = qw.to(torch.bfloat16), kw.to(torch.bfloat16)
        fq, fk = elementwise.qk_norm_rope(q, k, qw, kw, 1e-6, p, table)
        for got, x, w, what in ((fq, q, qw, "q"), (fk, k, kw, "k")):
            split = elementwise.rope(elementwise.rms_norm(x.contiguous(), w, 1e-6), p, table)
            assert_bitwise(got, split, f"d {d} {what}")
        cq, ck = cuda_ops.qk_norm_rope(q, k, qw, kw, 1e-6, p, table)
        assert_bitwise(cq, fq, f"d {d} q through the surface")
        cpu_q, cpu_k = cpu_ops.qk_norm_rope(q, k, qw, kw, 1e-6, p, table)
        assert_bitwise(cpu_q, cpu_rope.rope(cpu_norm.rms_norm(q, qw, 1e-6), p, table), "cpu q")
        assert_bitwise(cpu_k, cpu_rope.rope(cpu_norm.rms_norm(k, kw, 1e-6), p, table), "cpu k")
        _, other = elementwise.qk_norm_rope(q, k, qw, qw, 1e-6, p, table)
        differ(other, fk, f"d {d} k with q's weight")


@check
def kv_store_writes_each_row_at_its_slot() -> None:
    """One launch writes k's and v's rows (views into one qkv row; head dims 16 and 8, int64
    and int32 slots) at their slots: the cache `index_copy_` gives, every other slot unchanged.
    A row whose slot is outside the cache is not written (the device assert that stops the
    kernel on a GPU is not run by the interpreter: tests/gpu). Control: one slot off differs."""
    for d, hkv, idx in ((16, 2, torch.int64), (8, 3, torch.int32)):
        qkv = wide(4, (2 + 2 * hkv) * d, seed=d).to(torch.bfloat16)
        _, k, v = qkv.view(4, -1, d).split([2, hkv, hkv], dim=1)
        caches = [randn(12, hkv, d, seed=d + i).to(torch.bfloat16) for i in (1, 2)]
        slots = torch.tensor([9, 0, 11, 4], dtype=idx)
        want = [
            c.clone().index_copy_(0, slots.long(), x) for c, x in zip(caches, (k, v), strict=True)
        ]
        got = [c.clone() for c in caches]
        elementwise.kv_store(*got, slots, k, v)
        assert_bitwise(got[0], want[0], f"d {d} keys")
        assert_bitwise(got[1], want[1], f"d {d} values")
        off = [c.clone() for c in caches]
        elementwise.kv_store(*off, (slots + 1) % 12, k, v)
        differ(off[0], want[0], f"d {d} keys one slot off")
        outside = [c.clone() for c in caches]
        elementwise.kv_store(*outside, torch.tensor([9, 12, 11, -1], dtype=idx), k, v)
        for c, x, before, what in zip(outside, (k, v), caches, ("keys", "values"), strict=True):
            kept = before.clone()
            kept[[9, 11]] = x[[0, 2]]
            assert_bitwise(c, kept, f"d {d} {what}: rows at slots 12 and -1 dropped")


@check
def rope_positions_are_read_back_once_a_tensor() -> None:
    """Positions outside the table are refused by both rope ops, naming them. A positions
    tensor is read back once per version: the layers of a forward share it, so the second call
    reads nothing, and an in-place write makes the next call read it again (and refuse it).
    Control: a new tensor with the same values is read back."""
    table = cpu_rope.rope_table(16, 1e6, 64)
    x = randn(3, 2, 16, seed=3).to(torch.bfloat16)
    w = randn(16, seed=4).to(torch.bfloat16)
    for bad in ([0, 64, 1], [0, -1, 1]):
        ops = {
            "rope": lambda p: elementwise.rope(x, p, table),
            "qk_norm_rope": lambda p: elementwise.qk_norm_rope(x, x, w, w, 1e-6, p, table),
        }
        for name, op in ops.items():
            try:
                op(torch.tensor(bad))
            except ValueError as e:
                assert f"positions {min(bad)}..{max(bad)}" in str(e) and "64" in str(e), str(e)
            else:
                raise AssertionError(f"{name} took positions {bad} with a 64-row table")
    reads = []
    aminmax = torch.aminmax
    torch.aminmax = lambda t: reads.append(t) or aminmax(t)
    try:
        pos = torch.tensor([0, 9, 63])
        first = elementwise.rope(x, pos, table)
        assert_bitwise(elementwise.rope(x, pos, table), first, "the same positions again")
        assert len(reads) == 1, f"{len(reads)} read-backs for one unchanged positions tensor"
        elementwise.rope(x, pos.clone(), table)
        assert len(reads) == 2, "a new positions tensor was not read back"
        pos[1] = 64
        try:
            elementwise.rope(x, pos, table)
        except ValueError:
            pass
        else:
            raise AssertionError("a position written past the table after a check was taken")
        assert len(reads) == 3, f"{len(reads)} read-backs after an in-place write"
    finally:
        torch.aminmax = aminmax


if __name__ == "__main__":
    for name, fn in CHECKS.items():
        try:
            fn()
            print(f"{name} ok", flush=True)
        except Exception as e:  # report every check, not just the first failure
            print(f"{name} FAIL {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    print(f"END {len(CHECKS)}", flush=True)
    sys.exit(0)
