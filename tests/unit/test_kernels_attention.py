"""Attention: the same bits for a query whether it came through packed varlen prefill (alone or
with other sequences, anywhere in the pack), chunked prefill over a paged cache (any chunk
size, any page layout) or one-token decode; heads split across TP ranks; backward vs SDPA.

Negative controls: SDPA gives different bits for decode vs prefill, chunked vs whole, and a
sequence packed with others (block-diagonal mask) vs alone on the CPU; on CUDA, for decode vs
prefill.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from adversarial import CUDA, DEVICES, DTYPES, PROPERTY
from adversarial import wide as _wide
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K

PROPERTY = settings(PROPERTY, max_examples=20)
HQ, HKV, D, PAGE = 4, 2, 16, 16


# A narrower exponent spread: scores multiply two wide values; wider only saturates softmax.
wide = partial(_wide, spread=3)


def qkv(n: int, seed: int, dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    return tuple(
        wide(n, heads, D, seed=seed + i, dtype=dtype, device=device)
        for i, heads in enumerate((HQ, HKV, HKV))
    )


class Paged:
    """A paged cache for one request with a scrambled page table."""

    def __init__(self, n: int, dtype, seed: int, device: str = "cpu") -> None:
        pages = -(-n // PAGE) + 3
        shape = (pages, PAGE, HKV, D)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)  # unused slots: NaN
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.table = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        self.table = self.table.to(device)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        self.k[self.table[pos // PAGE], pos % PAGE] = k
        self.v[self.table[pos // PAGE], pos % PAGE] = v

    def attend(self, q: torch.Tensor, kv_len: int) -> torch.Tensor:
        return K.paged_attention(q, self.k, self.v, [0, q.shape[0]], [self.table], [kv_len])


def chunked(q, k, v, chunks: list[int], seed: int) -> torch.Tensor:
    """Prefill through the paged cache in the given chunk sizes (write first, then read)."""
    cache, outs, start = Paged(q.shape[0], q.dtype, seed, q.device), [], 0
    for c in chunks:
        cache.write(start, k[start : start + c], v[start : start + c])
        outs.append(cache.attend(q[start : start + c], start + c))
        start += c
    return torch.cat(outs)


def cut(n: int, size: int) -> list[int]:
    return [min(size, n - a) for a in range(0, n, size)]


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    n=st.integers(1, 150),
    chunk=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_chunked_prefill_and_decode_equal_packed_prefill(device, n, chunk, dtype, seed):
    q, k, v = qkv(n, seed, dtype, device)
    ref = K.attention(q, k, v, [0, n])
    got = chunked(q, k, v, cut(n, chunk), seed)
    assert torch.equal(got, ref), f"chunk {chunk}: {(got != ref).sum()} elements differ"
    decode = chunked(q, k, v, [1] * n, seed + 1)
    assert torch.equal(decode, ref), f"decode: {(decode != ref).sum()} elements differ"


@pytest.mark.parametrize("device", DEVICES)
@PROPERTY
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=5),
    which=st.integers(0, 4),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_packed_sequence_is_independent_of_its_neighbours(device, lens, which, dtype, seed):
    which %= len(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v = qkv(cu[-1], seed, dtype, device)
    packed = K.attention(q, k, v, cu)
    a, b = cu[which], cu[which + 1]
    alone = K.attention(q[a:b], k[a:b], v[a:b], [0, b - a])
    assert torch.equal(packed[a:b], alone)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_paged_batch_of_prefill_and_decode_requests(device, dtype):
    """One paged call holding a decode request and two chunked-prefill requests."""
    lens, seqs, caches = [70, 33, 129], [], []
    for i, n in enumerate(lens):
        seqs.append(qkv(n, 100 + i, dtype, device))
        caches.append(Paged(n, dtype, 200 + i, device))
    starts, news = [69, 10, 64], [1, 23, 65]  # decode the last token; two chunks mid-prompt
    k_pages = torch.cat([c.k for c in caches])
    v_pages = torch.cat([c.v for c in caches])
    offset, tables, qs, cu = 0, [], [], [0]
    for (q, k, v), c, a, n in zip(seqs, caches, starts, news, strict=True):
        c.write(0, k[: a + n], v[: a + n])
        tables.append(c.table + offset)
        offset += c.k.shape[0]
        qs.append(q[a : a + n])
        cu.append(cu[-1] + n)
    k_pages = torch.cat([c.k for c in caches])
    v_pages = torch.cat([c.v for c in caches])
    ends = [a + n for a, n in zip(starts, news, strict=True)]
    out = K.paged_attention(torch.cat(qs), k_pages, v_pages, cu, tables, ends)
    for i, ((q, k, v), a, n) in enumerate(zip(seqs, starts, news, strict=True)):
        ref = K.attention(q, k, v, [0, len(q)])[a : a + n]
        assert torch.equal(out[cu[i] : cu[i + 1]], ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2])
def test_head_parallel_split_is_exact(device, tp):
    """TP splits heads (kv groups with their queries); a head's math never sees other heads."""
    q, k, v = qkv(50, 7, torch.bfloat16, device)
    full = K.attention(q, k, v, [0, 50])
    per_q, per_kv = HQ // tp, HKV // tp
    parts = []
    for r in range(tp):
        hq, hkv = slice(r * per_q, (r + 1) * per_q), slice(r * per_kv, (r + 1) * per_kv)
        parts.append(K.attention(q[:, hq], k[:, hkv], v[:, hkv], [0, 50]))
    assert torch.equal(torch.cat(parts, dim=1), full)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_sdpa_within_tolerance(device):
    q, k, v = qkv(100, 3, torch.float32, device)
    ref = sdpa(q, k, v)
    torch.testing.assert_close(K.attention(q, k, v, [0, 100]), ref, rtol=1e-5, atol=1e-5)


# --- negative controls ------------------------------------------------------------------------
def sdpa(q, k, v, causal=True, mask=None):
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=causal and mask is None, attn_mask=mask
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_sdpa_decode_and_chunks_differ_from_prefill(dtype):
    """CPU SDPA tiles queries and keys by the call's own lengths: decode (q_len 1) and 64-token
    chunks regroup the key sums, so the bits move (short sequences can happen to agree)."""
    n, c = 300, 64
    q, k, v = qkv(n, 11, dtype)
    full = sdpa(q, k, v)
    decode = torch.cat([sdpa(q[i : i + 1], k[: i + 1], v[: i + 1], causal=False) for i in range(n)])
    assert not torch.equal(decode, full)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    chunks = [sdpa(q[a : a + c], k[: a + c], v[: a + c], mask=causal[a : a + c, : a + c])
              for a in range(0, n, c)]  # fmt: skip
    assert not torch.equal(torch.cat(chunks), full)


def test_negative_control_sdpa_packed_differs_from_alone():
    """A sequence packed after another (block-diagonal mask) is tiled from a different offset.
    (CUDA SDPA happens to give the packed sequence the same bits here, so no CUDA twin.)"""
    lens = [37, 300]
    n = sum(lens)
    q, k, v = qkv(n, 12, torch.float32)
    seg = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    packed = sdpa(q, k, v, mask=mask)
    alone = sdpa(q[37:], k[37:], v[37:])
    assert not torch.equal(packed[37:], alone)
    exact = K.attention(q, k, v, [0, 37, n])
    assert torch.equal(exact[37:], K.attention(q[37:], k[37:], v[37:], [0, n - 37]))


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_cuda_sdpa_decode_differs_from_prefill(device, dtype):
    """CUDA SDPA picks its kernel and how it splits the keys from the call's shape: a one-query
    decode step (split-KV for few queries) regroups the key sums of the causal prefill."""
    n = 512
    q, k, v = qkv(n, 11, dtype, device)
    full = sdpa(q, k, v)
    decode = torch.cat([sdpa(q[i : i + 1], k[: i + 1], v[: i + 1], causal=False) for i in range(n)])
    assert not torch.equal(decode, full)
    assert torch.equal(chunked(q, k, v, [1] * n, 11), K.attention(q, k, v, [0, n]))


# --- backward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_sdpa_autograd(device):
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in qkv(65, 21, torch.float32, device))
    g = torch.randn(65, HQ, D).to(device)
    (K.attention(q, k, v, [0, 20, 65]) * g).sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.cat([sdpa(qr[:20], kr[:20], vr[:20]), sdpa(qr[20:], kr[20:], vr[20:])])
    (ref * g).sum().backward()
    for ours, theirs in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
