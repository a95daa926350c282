"""RMSNorm (with the fused residual pair), RoPE, SiLU-mul and embedding: a row's bits depend only
on that row (batch size, position in the batch, offset in memory), plus backward vs autograd.

Each property is a harness that takes the op; the exact op must hold it, and a negative control
runs the same harness on a plain op that breaks it:
- RMSNorm rows: the plain `pow(2).mean(-1)` under `K.native_ops()`, at a row wider than torch's
  intra-op grain (32768 elements), with 4 threads: torch splits a lone row's sum across threads
  but sums each row of a batch on one thread. Below the grain it holds on CPU (one serial loop
  per row), which is why the control uses a wide row.
- RMSNorm fused pair: SGLang's native RMSNorm, which normalises the unrounded fp32 sum x + r.
- SiLU-mul: `F.silu` under `K.native_ops()` (its SIMD kernels compute a tensor's tail with a
  scalar formula).
- q/k norm + RoPE (one op, fused on CUDA) against the backend's rms_norm then rope: the plain
  HF steps under `K.native_ops()` in the same comparison.
RoPE and the embedding gather are elementwise, and so are their plain forms (per-call cos/sin
included: torch.cos/sin give every element the same bits on CPU): no plain op breaks them on
CPU, so they have no control. On CUDA the row reduction (RMSNorm's mean square) breaks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from adversarial import (
    CUDA,
    DEVICES,
    DTYPES,
    PROPERTY,
    Pairs,
    assert_bitwise,
    assert_holds,
    count_broken,
    n_differ,
    num_threads,
    wide,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K

EPS = 1e-6


def each_row_alone(fn, *batched: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(*(t[i : i + 1] for t in batched)) for i in range(batched[0].shape[0])])


# --- RMSNorm ----------------------------------------------------------------------------------
def rms_norm_rows(rms_norm: Callable, x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> Pairs:
    """A batch against each row alone and against the batch less its first row, plain and fused."""
    out = rms_norm(x, w, EPS)
    normed, res = rms_norm(x, w, EPS, residual=r)
    alone = [rms_norm(x[i : i + 1], w, EPS, residual=r[i : i + 1]) for i in range(x.shape[0])]
    return [
        ("rows alone", out, each_row_alone(lambda a: rms_norm(a, w, EPS), x)),
        ("batch less row 0", out[1:], rms_norm(x[1:], w, EPS)),
        ("fused normed, rows alone", normed, torch.cat([a for a, _ in alone])),
        ("fused residual, rows alone", res, torch.cat([b for _, b in alone])),
    ]


def norm_inputs(m: int, h: int, seed: int, dtype, device: str = "cpu"):
    x = wide(m, h, seed=seed, dtype=dtype, device=device)
    r = wide(m, h, seed=seed + 1, dtype=dtype, device=device)
    w = wide(h, seed=seed + 2, dtype=dtype, spread=1, device=device)
    return x, w, r


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=200)
@given(
    m=st.integers(1, 33),
    h=st.sampled_from([16, 64, 200, 256, 384, 640, 2048, 4096]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_rows_are_independent(device, m, h, dtype, seed):
    assert_holds(rms_norm_rows(K.rms_norm, *norm_inputs(m, h, seed, dtype, device)))


LONG_ROW = 65536
"""Wider than torch's intra-op grain (32768): a lone row's plain sum is split across threads."""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_negative_control_plain_rms_norm_splits_a_long_row_over_threads(seed):
    """With 4 threads, torch sums a lone 65536-wide row in per-thread pieces (output of one
    element) but each row of a 32-row batch on one thread. The pieces regroup the fp32 mean
    square, and where a last bit moves the row's output moves with it: 5, 4 and 9 of the 32 rows
    alone, 9, 11 and 8 fused (seeds 0-2; 0.79M, 0.85M and 0.99M of 8.3M outputs). fp32 inputs:
    the plain op's bf16 output rounds the difference away here. The exact op holds on the same
    inputs, threads and shapes."""
    x, w, r = norm_inputs(32, LONG_ROW, seed, torch.float32)
    with num_threads(4):
        exact = rms_norm_rows(K.rms_norm, x, w, r)
        with K.native_ops():
            plain = rms_norm_rows(K.rms_norm, x, w, r)
    assert_holds(exact)
    differ, total, lines = count_broken(plain)
    assert differ > 0, f"plain rms_norm held on {total} outputs: {lines}"


def rms_norm_fused_pair(rms_norm: Callable, x, w, r) -> Pairs:
    """(normed, new residual) of the fused call against the unfused add-then-norm."""
    normed, res = rms_norm(x, w, EPS, residual=r)
    return [("new residual", res, x + r), ("normed", normed, rms_norm(x + r, w, EPS))]


def sglang_rms_norm(x, w, eps, residual=None):
    """SGLang's RMSNorm.forward_native (layernorm.py:828-877): the residual added in fp32 and
    rounded for the new residual, while the unrounded fp32 sum is normalised."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (y * w.float()).to(x.dtype)
    return out if residual is None else (out, xf.to(x.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 2048])
def test_rms_norm_residual_pair_semantics(device, dtype, h):
    """(normed, new_residual): new_residual = x + residual, and normed is the norm of it, so the
    fused call equals the unfused add-then-norm bit for bit."""
    x, w, r = norm_inputs(64, h, 1, dtype, device)
    assert_holds(rms_norm_fused_pair(K.rms_norm, x, w, r))
    normed = K.rms_norm(x, w, EPS, residual=r)[0]
    xf = (x + r).float()
    ref = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype).float()
    tol = {"rtol": 1.6e-2, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 0}
    torch.testing.assert_close(normed.float(), ref, **tol)


@pytest.mark.parametrize("h", [64, 2048])
def test_negative_control_sglang_fused_rms_norm_is_not_the_unfused_norm(h):
    """SGLang normalises x + r before rounding it, the unfused call normalises the rounded bf16
    sum: 849 of 4096 (h 64) and 23469 of 131072 (h 2048) normed outputs differ. In fp32 the
    sum is rounded to fp32 either way, so it holds there: bf16 only."""
    x, w, r = norm_inputs(64, h, 1, torch.bfloat16)
    assert_holds(rms_norm_fused_pair(K.rms_norm, x, w, r))
    differ, total, lines = count_broken(rms_norm_fused_pair(sglang_rms_norm, x, w, r))
    assert differ > 0, f"SGLang's fused pair held on {total} outputs: {lines}"


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_cuda_rms_norm_depends_on_batch_size(device, dtype):
    """torch's CUDA reduction sizes its thread block from the number of rows as well as their
    length: a row alone is split over more threads than each of 48 rows, so the plain RMSNorm's
    fp32 mean square gets other bits (10 of 48 rows from fp32 inputs, 13 from bf16, on an
    H200). The plain output rounded back to bf16 can hide that, so the control checks the sum;
    the exact op's outputs hold on the same inputs."""
    x, w, r = norm_inputs(48, 4096, 4, dtype, device)
    ms = x.float().pow(2).mean(-1)
    alone = each_row_alone(lambda a: a.float().pow(2).mean(-1), x)
    assert n_differ(ms, alone) > 0, "the plain CUDA mean square held for all 48 rows"
    assert_holds(rms_norm_rows(K.rms_norm, x, w, r))


# --- RoPE -------------------------------------------------------------------------------------
def rope_rows(rope: Callable, x: torch.Tensor, pos: torch.Tensor, table, seed: int) -> Pairs:
    out = rope(x, pos, table)
    perm = torch.randperm(len(pos), generator=torch.Generator().manual_seed(seed)).to(x.device)
    return [
        ("tokens alone", out, each_row_alone(lambda a, p: rope(a, p, table), x, pos)),
        ("permuted batch", rope(x[perm], pos[perm], table), out[perm]),
    ]


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=200)
@given(
    positions=st.lists(st.integers(0, 40959), min_size=1, max_size=24),
    head_dim=st.sampled_from([16, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_depends_only_on_the_token_and_its_position(device, positions, head_dim, dtype, seed):
    table = rope_tables(head_dim).to(device)
    pos = torch.tensor(positions, device=device)
    x = wide(len(positions), 4, head_dim, seed=seed, dtype=dtype, device=device)
    assert_holds(rope_rows(K.rope, x, pos, table, seed))


_TABLES: dict[int, torch.Tensor] = {}


def rope_tables(head_dim: int) -> torch.Tensor:
    """One Qwen3 table (theta 1e6, 40960 positions) per head_dim, built once per session."""
    if head_dim not in _TABLES:
        _TABLES[head_dim] = K.rope_table(head_dim, 1e6, 40960)
    return _TABLES[head_dim]


@pytest.mark.parametrize("device", DEVICES)
def test_rope_matches_hf_neox_rotation(device):
    torch.manual_seed(0)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    table = K.rope_table(16, 1e6, 512).to(device)
    pos = torch.tensor([0, 1, 7, 300, 511], device=device)
    x = torch.randn(5, 4, 16).to(device)
    cos, sin = torch.cat([table[pos, :8]] * 2, -1), torch.cat([table[pos, 8:]] * 2, -1)
    q, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    torch.testing.assert_close(K.rope(x, pos, table), q.transpose(0, 1), rtol=1e-6, atol=1e-6)
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2, device=device).float() / 16))
    torch.testing.assert_close(table[pos, :8], torch.cos(pos[:, None].float() * inv))


# --- q/k norm + RoPE --------------------------------------------------------------------------
QK_HEADS = [(4, 2), (32, 4), (6, 1)]
"""(q heads, kv heads): GQA 2, Qwen3-30B-A3B's, and a kv stride that is no multiple of 16."""


def qk_norm_rope_pairs(qk_norm_rope: Callable, qkv: torch.Tensor, heads: tuple[int, int],
                       d: int, qw, kw, pos, table) -> Pairs:  # fmt: skip
    """`qk_norm_rope` on q and k read in place from one qkv row, against the backend's rms_norm
    then rope of contiguous copies, and the last token alone against the batch."""
    hq, hkv = heads
    q, k, _ = qkv.view(qkv.shape[0], -1, d).split([hq, hkv, hkv], dim=1)
    fq, fk = qk_norm_rope(q, k, qw, kw, EPS, pos, table)
    aq, ak = qk_norm_rope(q[-1:], k[-1:], qw, kw, EPS, pos[-1:], table)
    return [
        ("q", fq, K.rope(K.rms_norm(q.contiguous(), qw, EPS), pos, table)),
        ("k", fk, K.rope(K.rms_norm(k.contiguous(), kw, EPS), pos, table)),
        ("last token alone, q", aq, fq[-1:]),
        ("last token alone, k", ak, fk[-1:]),
    ]


def qk_inputs(t: int, heads: tuple[int, int], d: int, dtype, seed: int, device: str = "cpu"):
    qkv = wide(t, (heads[0] + 2 * heads[1]) * d, seed=seed, dtype=dtype, device=device)
    qw = wide(d, seed=seed + 1, dtype=dtype, spread=1, device=device)
    kw = wide(d, seed=seed + 2, dtype=dtype, spread=1, device=device)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 40960, (t,), generator=g).to(device)
    return qkv, qw, kw, pos, rope_tables(d).to(device)


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=60)
@given(
    t=st.integers(1, 33),
    heads=st.sampled_from(QK_HEADS),
    d=st.sampled_from([16, 64, 128]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_qk_norm_rope_is_rms_norm_then_rope(device, t, heads, d, dtype, seed):
    qkv, qw, kw, pos, table = qk_inputs(t, heads, d, dtype, seed, device)
    assert_holds(qk_norm_rope_pairs(K.qk_norm_rope, qkv, heads, d, qw, kw, pos, table))


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_the_plain_qk_norm_and_rotation_are_not_the_exact_ops(device):
    """HF's q/k norm and rotation (cos and sin rounded to bf16, the product in bf16) in the
    harness above: the q and k comparisons break."""

    def plain(*args):
        with K.native_ops():
            return K.qk_norm_rope(*args)

    qkv, qw, kw, pos, table = qk_inputs(9, (32, 4), 128, torch.bfloat16, 3, device)
    pairs = qk_norm_rope_pairs(plain, qkv, (32, 4), 128, qw, kw, pos, table)
    differ, total, lines = count_broken(pairs[:2])
    assert differ > 0, f"the plain q/k norm and rotation held on {total} outputs: {lines}"


@pytest.mark.parametrize("device", DEVICES)
def test_qk_norm_rope_backward_is_the_plain_steps(device):
    torch.manual_seed(0)
    table = K.rope_table(16, 1e4, 64).to(device)
    q, k = torch.randn(5, 4, 16).to(device), torch.randn(5, 2, 16).to(device)
    qw, kw = (1 + 0.1 * torch.randn(16)).to(device), (1 + 0.1 * torch.randn(16)).to(device)
    pos = torch.tensor([0, 3, 9, 20, 63], device=device)
    ours = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    theirs = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    oq, ok = K.qk_norm_rope(*ours, 1e-6, pos, table)
    (oq.pow(2).sum() + 1.5 * ok.sum()).backward()
    rq = K.rope(K.rms_norm(theirs[0], theirs[2], 1e-6), pos, table)
    rk = K.rope(K.rms_norm(theirs[1], theirs[3], 1e-6), pos, table)
    (rq.pow(2).sum() + 1.5 * rk.sum()).backward()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# --- SiLU-mul and embedding -------------------------------------------------------------------
def silu_mul_offsets(silu_mul: Callable, g: torch.Tensor, u: torch.Tensor) -> Pairs:
    """Slices at several lengths and offsets in memory against the whole tensor, and the rows
    of a [64, 64] view alone against the view."""
    full = silu_mul(g, u)
    pairs = [
        (f"[{off}:{off + n}]", silu_mul(g[off : off + n], u[off : off + n]), full[off : off + n])
        for n in (1, 3, 5, 17, 33)
        for off in range(0, 40, 3)
    ]
    gm, um = g.view(64, 64), u.view(64, 64)
    return [*pairs, ("rows alone", silu_mul(gm, um), each_row_alone(silu_mul, gm, um))]


def silu_inputs(seed: int, dtype, device: str = "cpu"):
    g = wide(4096, seed=seed, dtype=dtype, spread=4, device=device)
    return g, wide(4096, seed=seed + 1, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_silu_mul_is_invariant_to_offset_and_batch(device, dtype, seed):
    g, u = silu_inputs(seed, dtype, device)
    assert_holds(silu_mul_offsets(K.silu_mul, g, u))
    ref = F.silu(g.float()) * u.float()
    tol = (
        {"rtol": 1.6e-2, "atol": 1e-30}
        if dtype == torch.bfloat16
        else {"rtol": 2e-6, "atol": 1e-30}
    )
    torch.testing.assert_close(K.silu_mul(g, u).float(), ref, **tol)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="no SIMD: F.silu computes every element with the scalar formula, nothing to break",
)
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_negative_control_f_silu_depends_on_offset_in_fp32(seed):
    """On SIMD CPUs fp32 F.silu computes a tensor's tail with a scalar formula that differs from
    the vector one in the last bit, so the same value gets different bits at different offsets
    (7 to 18 of 4922 outputs on AVX512, seeds 5-7). In bf16 the rounding hides it: fp32 only."""
    g, u = silu_inputs(seed, torch.float32)
    assert_holds(silu_mul_offsets(K.silu_mul, g, u))
    with K.native_ops():
        differ, total, lines = count_broken(silu_mul_offsets(K.silu_mul, g, u))
    assert differ > 0, f"F.silu held on {total} outputs: {lines}"


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_is_a_gather(device):
    w = wide(50, 8, seed=7, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 49, 0, 3], device=device)
    assert_bitwise(K.embedding(ids, w), w[ids], "gather")
    assert_bitwise(K.embedding(ids[1:2], w), K.embedding(ids, w)[1:2], "one id alone")


# --- backward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_autograd(device):
    torch.manual_seed(0)
    x, r = (torch.randn(6, 64).to(device).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(64)).to(device).requires_grad_()
    g = torch.randn(6, 64).to(device)
    normed, res = K.rms_norm(x, w, 1e-6, residual=r)
    (normed * g + res * g).sum().backward()
    xr, rr, wr = (t.detach().clone().requires_grad_() for t in (x, r, w))
    s = xr + rr
    ref = wr * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    (ref * g + s * g).sum().backward()
    for ours, theirs in ((x, xr), (r, rr), (w, wr)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)

    table = K.rope_table(16, 1e4, 64).to(device)
    q = torch.randn(5, 2, 16).to(device).requires_grad_()
    pos = torch.tensor([0, 3, 9, 20, 63], device=device)
    (K.rope(q, pos, table) * 1.5).sum().backward()
    qr = q.detach().clone().requires_grad_()
    c, s_ = table[pos, None, :8], table[pos, None, 8:]
    a, b = qr[..., :8], qr[..., 8:]
    (torch.cat([a * c - b * s_, b * c + a * s_], -1) * 1.5).sum().backward()
    torch.testing.assert_close(q.grad, qr.grad)

    gate, up = (torch.randn(7, 32).to(device).requires_grad_() for _ in range(2))
    K.silu_mul(gate, up).pow(2).sum().backward()
    gr, ur = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    (F.silu(gr) * ur).pow(2).sum().backward()
    torch.testing.assert_close(gate.grad, gr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad, ur.grad, rtol=1e-5, atol=1e-6)
