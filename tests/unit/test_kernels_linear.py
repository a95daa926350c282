"""Exact linear: row (batch) invariance, TP row-parallel exactness, the exactness rule, backward.

Inputs have wide exponents (2^-12 .. 2^12 per element), so any change of summation order shows
in the fp32 result; each property's negative control runs the plain torch op (MKL on CPU,
cuBLAS on CUDA) on the same kind of input and asserts that it breaks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from adversarial import CUDA, DEVICES, DTYPES, PROPERTY, wide
from hypothesis import assume, given
from hypothesis import strategies as st
from onpolicy import kernels as K


def mismatches(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.float() - b.float()).abs()
    return f"{int((a != b).sum())} of {a.numel()} elements differ, max_delta {diff.max():.3e}"


# --- batch invariance ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    m=st.integers(1, 40),
    row=st.integers(0, 39),
    k=st.sampled_from([16, 64, 128, 200, 384]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_row_is_independent_of_batch_size_and_position(device, m, row, k, dtype, seed):
    row = row % m
    x = wide(m, k, seed=seed, dtype=dtype, device=device)
    w = wide(24, k, seed=seed + 1, dtype=dtype, spread=4, device=device)
    alone = K.linear(x[row : row + 1], w)[0]
    for batch, at in ((x, row), (torch.cat([x.flip(0), x]), m + row), (x[row:], 0)):
        got = K.linear(batch, w)[at]
        assert torch.equal(got, alone), mismatches(got, alone)


def test_negative_control_torch_linear_depends_on_batch_size():
    """fp32 F.linear (MKL) picks its kernel from the whole shape: a row's bits change with M."""
    x, w = wide(64, 256, seed=1), wide(96, 256, seed=2, spread=4)
    full = F.linear(x, w)
    rows = torch.cat([F.linear(x[i : i + 1], w) for i in range(64)])
    assert not torch.equal(full, rows)
    exact = K.linear(x, w)
    assert torch.equal(exact, torch.cat([K.linear(x[i : i + 1], w) for i in range(64)]))


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_cublas_linear_depends_on_batch_size(device, dtype):
    """cuBLAS picks its kernel (tiles, split-K) from the whole shape: a row's bits differ between
    a batch of 2048 and the row alone, in fp32 and bf16."""
    x = wide(2048, 4096, seed=1, dtype=dtype, device=device)
    w = wide(4096, 4096, seed=2, dtype=dtype, spread=4, device=device)
    rows = range(0, 2048, 128)
    full = F.linear(x, w)[rows]
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in rows])
    assert not torch.equal(full, alone), mismatches(full, alone)
    exact = K.linear(x, w)[rows]
    assert torch.equal(exact, torch.cat([K.linear(x[i : i + 1], w) for i in rows]))


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dims_and_bias(device):
    x, w = wide(3, 5, 96, seed=3, device=device), wide(40, 96, seed=4, device=device)
    b = wide(40, seed=5, device=device)
    out = K.linear(x, w, b)
    assert out.shape == (3, 5, 40)
    assert torch.equal(out, K.linear(x.reshape(15, 96), w, b).view(3, 5, 40))
    assert torch.equal(out, K.combine_partials([K.linear_partial(x, w)], x.dtype, b))
    scale = (x.abs() @ w.abs().T).max()
    torch.testing.assert_close(out, x @ w.T + b, rtol=0, atol=1e-6 * float(scale))


# --- tensor parallel (row-parallel) -------------------------------------------------------------
def shards(x: torch.Tensor, w: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each simulated rank's fp32 partial over its contiguous K-slice."""
    xs, ws = x.chunk(tp, dim=-1), w.chunk(tp, dim=-1)
    return [K.linear_partial(a, b) for a, b in zip(xs, ws, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    k=st.sampled_from([64, 128, 256, 512, 1024, 2048, 4096]),
    tp=st.sampled_from([1, 2, 4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_row_parallel_partials_combine_to_the_unsharded_bits(device, k, tp, dtype, seed):
    assume(K.row_parallel_exact(k, tp, device))  # CUDA also needs whole MMA leaves per shard
    x = wide(6, k, seed=seed, dtype=dtype, device=device)
    w, b = wide(10, k, seed=seed + 1, dtype=dtype, device=device), None
    if seed % 2:
        b = wide(10, seed=seed + 2, dtype=dtype, device=device)
    full = K.linear(x, w, b)
    sharded = K.combine_partials(shards(x, w, tp), dtype, b)
    assert torch.equal(sharded, full), mismatches(sharded, full)
    assert torch.equal(K.row_parallel_linear(x, w, tp, b), full)
    # The fp32 partials themselves agree before any rounding, not just after the cast.
    assert torch.equal(K.pairwise_tree_sum(shards(x, w, tp)), K.linear_partial(x, w))


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_naive_shard_sum_differs(device):
    """Summing the shards' partials left to right (or the BLAS partials) is not the tree.
    K = 4096 keeps each of the 4 shards whole leaves on CUDA too (see the leaf rule)."""
    x, w = wide(8, 4096, seed=7, device=device), wide(16, 4096, seed=8, device=device)
    full = K.linear(x, w)
    parts = shards(x, w, 4)
    left_to_right = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(left_to_right, full)
    blas = sum(a @ b.T for a, b in zip(x.chunk(4, -1), w.chunk(4, -1), strict=True))
    assert not torch.equal(blas, full)
    assert torch.equal(K.row_parallel_linear(x, w, 4), full)


@pytest.mark.parametrize(
    ("k", "tp", "exact"),
    [
        (768, 1, True),  # Qwen3-30B-A3B expert K, unsharded
        (768, 2, False),  # 3 blocks per shard: not an aligned subtree
        (768, 4, False),
        (2048, 2, True),  # hidden 2048: 8 blocks per shard
        (4096, 8, True),  # attention K = 32 heads x 128: 4 blocks per shard
        (1536, 2, False),  # 6 blocks per shard
        (64, 8, True),  # below one block: 8-element aligned slices of the element tree
        (96, 2, False),
        (1024, 3, False),  # not a power of 2
        (100, 8, False),  # does not divide
    ],
)
def test_row_parallel_exact_rule(k, tp, exact):
    assert K.row_parallel_exact(k, tp) is exact


@pytest.mark.parametrize(
    ("k", "tp", "exact"),
    [
        (4096, 8, True),  # o_proj at TP 8: one 512-wide leaf per shard
        (4096, 2, True),
        (2048, 4, True),
        (2048, 8, False),  # 256 per shard: half a leaf, inside the tensor core's chain
        (1024, 4, False),
        (64, 8, False),  # exact on CPU (element tree), not on CUDA
        (768, 1, True),
        (1536, 3, False),
    ],
)
def test_row_parallel_exact_rule_on_cuda(k, tp, exact):
    """The CUDA backend's leaves are chained MMAs, so a shard must hold whole leaves."""
    assert K.row_parallel_exact(k, tp, "cuda") is exact


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("k", "tp"), [(768, 2), (768, 4), (1536, 2), (96, 2)])
def test_inexact_shapes_really_differ_and_stay_deterministic(device, k, tp):
    """Where the rule says no, the sharded tree is a different sum: it shows on wide inputs. It
    is still the same bits for every engine cut at the same tp."""
    x, w = wide(16, k, seed=k + tp, device=device), wide(32, k, seed=k, device=device)
    full, sharded = K.linear(x, w), K.row_parallel_linear(x, w, tp)
    assert not torch.equal(sharded, full)
    assert torch.equal(sharded, K.row_parallel_linear(x.flip(0), w, tp).flip(0))


@pytest.mark.parametrize("device", DEVICES)
def test_rule_agrees_with_the_kernel_for_every_small_shape(device):
    x = wide(4, 1024, seed=11, device=device)
    w = wide(8, 1024, seed=12, device=device)
    for k in (32, 64, 96, 128, 192, 256, 384, 512, 640, 768, 1024):
        for tp in (2, 4, 8):
            if k % tp:
                continue
            same = torch.equal(
                K.row_parallel_linear(x[:, :k], w[:, :k], tp), K.linear(x[:, :k], w[:, :k])
            )
            if K.row_parallel_exact(k, tp, device):
                assert same, (k, tp)


# --- backward and dispatch ----------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_autograd(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 7, 192).to(dtype).to(device).requires_grad_()
    w = torch.randn(33, 192).to(dtype).to(device).requires_grad_()
    b = torch.randn(33).to(dtype).to(device).requires_grad_()
    g = torch.randn(5, 7, 33).to(device)
    (K.linear(x, w, b).float() * g).sum().backward()
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    ((xr @ wr.T + br) * g).sum().backward()
    tol = {"rtol": 2e-2, "atol": 2e-1} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    for ours, ref in ((x, xr), (w, wr), (b, br)):
        torch.testing.assert_close(ours.grad.float(), ref.grad, **tol)


def test_other_devices_are_refused_by_name():
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(NotImplementedError, match=r"onpolicy\.kernels\.linear: .*'meta'"):
        K.linear(x, torch.empty(3, 8, device="meta"))
    with pytest.raises(NotImplementedError, match="rms_norm"):
        K.rms_norm(x, torch.empty(8, device="meta"), 1e-6)
