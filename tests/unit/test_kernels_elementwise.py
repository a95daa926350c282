"""RMSNorm (with the fused residual pair), RoPE, SiLU-mul and embedding: a row's bits depend only
on that row (batch size, position in the batch, offset in memory), plus backward vs autograd.

Where the plain torch op is already invariant on CPU the negative control says so and asserts
it; `F.silu` is the one that is not. On CUDA the row reduction (RMSNorm's mean square) is the
one that breaks; RoPE, SiLU and the gather are elementwise there, so they get no CUDA control.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from adversarial import CUDA, DEVICES, DTYPES, PROPERTY, wide
from hypothesis import given
from hypothesis import strategies as st
from onpolicy import kernels as K


def each_row_alone(fn, *batched: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(*(t[i : i + 1] for t in batched)) for i in range(batched[0].shape[0])])


# --- RMSNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    m=st.integers(1, 33),
    h=st.sampled_from([16, 64, 200, 256]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_rows_are_independent(device, m, h, dtype, seed):
    x = wide(m, h, seed=seed, dtype=dtype, device=device)
    r = wide(m, h, seed=seed + 1, dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(seed))).to(dtype)
    w = w.to(device)
    out = K.rms_norm(x, w, 1e-6)
    assert torch.equal(out, each_row_alone(lambda a: K.rms_norm(a, w, 1e-6), x))
    assert torch.equal(out[1:], K.rms_norm(x[1:], w, 1e-6))
    normed, res = K.rms_norm(x, w, 1e-6, residual=r)
    alone = [K.rms_norm(x[i : i + 1], w, 1e-6, residual=r[i : i + 1]) for i in range(m)]
    assert torch.equal(normed, torch.cat([a for a, _ in alone]))
    assert torch.equal(res, torch.cat([b for _, b in alone]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_residual_pair_semantics(device, dtype):
    """(normed, new_residual): new_residual = x + residual, and normed is the norm of it, so the
    fused call equals the unfused add-then-norm bit for bit."""
    x = wide(9, 64, seed=1, dtype=dtype, device=device)
    r = wide(9, 64, seed=2, dtype=dtype, device=device)
    w = wide(64, seed=3, device=device).to(dtype)
    normed, res = K.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(res, x + r)
    assert torch.equal(normed, K.rms_norm(x + r, w, 1e-6))
    xf = (x + r).float()
    ref = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    tol = {"rtol": 1.6e-2, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 0}
    torch.testing.assert_close(normed.float(), ref, **tol)


def test_negative_control_torch_rms_norm_happens_to_be_row_invariant():
    """Plain `pow(2).mean(-1)` reduces each row with the same CPU kernel whatever M is, so it
    happens to be batch-invariant here; the exact op does not rely on that (explicit tree)."""
    x = wide(48, 256, seed=4)
    ms = x.pow(2).mean(-1)
    assert torch.equal(ms, each_row_alone(lambda a: a.pow(2).mean(-1), x))


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_cuda_rms_norm_depends_on_batch_size(device, dtype):
    """torch's CUDA reduction sizes its thread block from the number of rows as well as their
    length: a row alone is split over more threads than each of 48 rows, so the plain RMSNorm's
    fp32 mean square gets other bits (10 of 48 rows from fp32 inputs, 13 from bf16, on an
    H200). The plain output rounded back to bf16 can hide that, so the control checks the sum."""
    x = wide(48, 4096, seed=4, dtype=dtype, device=device)
    w = wide(4096, seed=5, dtype=dtype, spread=1, device=device)
    ms = x.float().pow(2).mean(-1)
    assert not torch.equal(ms, each_row_alone(lambda a: a.float().pow(2).mean(-1), x))
    exact = K.rms_norm(x, w, 1e-6)
    assert torch.equal(exact, each_row_alone(lambda a: K.rms_norm(a, w, 1e-6), x))


# --- RoPE -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    positions=st.lists(st.integers(0, 4095), min_size=1, max_size=24),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rope_depends_only_on_the_token_and_its_position(device, positions, dtype, seed):
    table = K.rope_table(16, 1e6, 4096).to(device)
    pos = torch.tensor(positions, device=device)
    x = wide(len(positions), 4, 16, seed=seed, dtype=dtype, device=device)
    out = K.rope(x, pos, table)
    assert torch.equal(out, each_row_alone(lambda a, p: K.rope(a, p, table), x, pos))
    perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(seed))
    perm = perm.to(device)
    assert torch.equal(K.rope(x[perm], pos[perm], table), out[perm])


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


def test_negative_control_plain_rope_is_elementwise_so_it_holds():
    """A rotation is elementwise; computing cos/sin per call from the batch's positions also
    gives the same bits per position on this CPU (torch.cos/sin take one SIMD path for every
    element). The table makes that independent of the batch by construction."""
    pos = torch.arange(0, 4000, 37)
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2).float() / 16))
    full = torch.cos(pos[:, None].float() * inv)
    assert torch.equal(full, each_row_alone(lambda p: torch.cos(p[:, None].float() * inv), pos))


# --- SiLU-mul and embedding -------------------------------------------------------------------
def offsets_agree(fn, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Does fn give every element the same bits at several lengths and offsets in memory?"""
    full = fn(x, y)
    for length in (1, 3, 5, 17, 33):
        for off in range(0, 40, 3):
            if not torch.equal(
                fn(x[off : off + length], y[off : off + length]), full[off : off + length]
            ):
                return False
    return True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_invariant_to_offset_and_batch(device, dtype):
    g = wide(4096, seed=5, dtype=dtype, spread=4, device=device)
    u = wide(4096, seed=6, dtype=dtype, device=device)
    assert offsets_agree(K.silu_mul, g, u)
    gm, um = g.view(64, 64), u.view(64, 64)
    assert torch.equal(K.silu_mul(gm, um), each_row_alone(K.silu_mul, gm, um))
    ref = F.silu(g.float()) * u.float()
    tol = (
        {"rtol": 1.6e-2, "atol": 1e-30}
        if dtype == torch.bfloat16
        else {"rtol": 2e-6, "atol": 1e-30}
    )
    torch.testing.assert_close(K.silu_mul(g, u).float(), ref, **tol)


def test_negative_control_f_silu_depends_on_offset_in_fp32():
    """On SIMD CPUs fp32 F.silu computes a tensor's tail with a scalar formula that differs from
    the vector one in the last bit, so the same value gets different bits at different offsets.
    Without SIMD (capability DEFAULT) every element takes the scalar path and it holds."""
    g, u = wide(4096, seed=5, spread=4), wide(4096, seed=6)
    plain_holds = offsets_agree(lambda a, b: F.silu(a) * b, g, u)
    assert plain_holds is (torch.backends.cpu.get_cpu_capability() == "DEFAULT")


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_is_a_gather(device):
    w = wide(50, 8, seed=7, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 49, 0, 3], device=device)
    assert torch.equal(K.embedding(ids, w), w[ids])
    assert torch.equal(K.embedding(ids[1:2], w), K.embedding(ids, w)[1:2])


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
