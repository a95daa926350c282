"""Attention: a token's bits are the same whether the trainer computes it in a packed varlen call
(any neighbours, anywhere in the pack) or the rollout engine computes it by chunked prefill over
a paged cache (any chunk size, any page layout, batched with other requests that are prefilling
or decoding) or by one-token decode; heads split across TP ranks; backward vs SDPA.

The property is a harness that takes the two calls (packed, paged); the exact ops must hold it,
and the negative control runs the same harness on what the engines really run, which breaks it:
- SGLang's torch_native backend (per request, SDPA over the request's whole history: causal
  over a full-length query buffer for an extend, q_len 1 and no mask for a decode) against the
  trainer's per-sequence causal SDPA (how a thd-capable core attention handles packed
  sequences: each segment alone);
- the same body inside `K.native_ops()` (per-request SDPA with a position mask: HF's cache path).
Both break through chunking and decode: SDPA tiles by the call's own lengths. A packed
sequence's independence from its neighbours alone has no control: every engine runs attention
per sequence, so no plain path mixes them. Neither has the head split: a head's SDPA or eager
(baddbmm, softmax, bmm) output is the same whichever other heads are in the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from adversarial import (
    DEVICES,
    DTYPES,
    PROPERTY,
    Pairs,
    assert_bitwise,
    assert_holds,
    count_broken,
    num_threads,
)
from adversarial import wide as _wide
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K
from onpolicy.kernels import native

HQ, HKV, D, PAGE = 4, 2, 16, 16

# A narrower exponent spread: scores multiply two wide values; wider only saturates softmax.
wide = partial(_wide, spread=3)


def qkv(n: int, seed: int, dtype, device: str = "cpu", hq: int = HQ, hkv: int = HKV):
    return tuple(
        wide(n, heads, D, seed=seed + i, dtype=dtype, device=device)
        for i, heads in enumerate((hq, hkv, hkv))
    )


def spans(cu: Sequence[int]) -> list[tuple[int, int]]:
    return list(zip(cu[:-1], cu[1:], strict=True))


def cumulative(sizes: Sequence[int]) -> list[int]:
    cu = [0]
    for s in sizes:
        cu.append(cu[-1] + s)
    return cu


class Pool:
    """One paged KV pool shared by every request: scrambled page tables, NaN in unused slots."""

    def __init__(self, lens: Sequence[int], dtype, seed: int, device: str) -> None:
        need = [-(-n // PAGE) for n in lens]
        shape = (sum(need) + 3, PAGE, HKV, D)
        self.k = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.v = torch.full(shape, float("nan"), dtype=dtype, device=device)
        perm = torch.randperm(shape[0], generator=torch.Generator().manual_seed(seed))
        self.tables = [t.to(device) for t in perm[: sum(need)].split(need)]

    def write(self, req: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        slot = self.tables[req][pos // PAGE], pos % PAGE
        self.k[slot], self.v[slot] = k, v


def gather(pages: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """A request's first n positions from the pool, as SGLang reads them through req_to_token."""
    pos = torch.arange(n, device=pages.device)
    return pages[table[pos // PAGE], pos % PAGE]


# --- the two calls: exact, and what the engines run -------------------------------------------
Packed = Callable[..., torch.Tensor]
"""(q, k, v, cu_seqlens) -> out: the trainer's packed varlen call."""
Paged = Callable[..., torch.Tensor]
"""(q, k_pages, v_pages, cu_seqlens_q, page_tables, kv_lens, decode) -> out: one engine step."""


def exact_paged(q, k_pages, v_pages, cu, tables, kv_lens, decode: bool) -> torch.Tensor:
    return K.paged_attention(q, k_pages, v_pages, K.PagedBatch(cu, tables, kv_lens))


def sdpa(q, k, v, causal: bool, mask=None) -> torch.Tensor:
    """q [Tq, Hq, D], k, v [Tk, Hkv, D] of one sequence, GQA by SDPA."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    return o[0].transpose(0, 1)


def sglang_torch_native(q, k_pages, v_pages, cu, tables, kv_lens, decode: bool) -> torch.Tensor:
    """SGLang's TorchNativeAttnBackend (torch_native_backend.py): per request, the whole K/V
    history gathered from the pool; forward_decode runs SDPA with q_len 1 and no mask,
    forward_extend runs one causal SDPA over a query buffer as long as the history, whose prefix
    rows are left unset (zeros here), and keeps the new rows."""
    outs = []
    for (a, b), table, n in zip(spans(cu), tables, kv_lens, strict=True):
        k, v = gather(k_pages, table, n), gather(v_pages, table, n)
        if decode:
            outs.append(sdpa(q[a:b], k, v, causal=False))
            continue
        buf = q.new_zeros((n, *q.shape[1:]))
        buf[n - (b - a) :] = q[a:b]
        outs.append(sdpa(buf, k, v, causal=True)[n - (b - a) :])
    return torch.cat(outs)


EXACT = (K.attention, exact_paged)
SGLANG = (native.attention, sglang_torch_native)
"""The trainer's per-sequence causal SDPA (`native.attention`) with SGLang's torch_native."""


# --- the harness ------------------------------------------------------------------------------
def rollout_vs_training(
    ops: tuple[Packed, Paged],
    lens: Sequence[int],
    prompts: Sequence[int],
    chunk: int,
    order: Sequence[int],
    dtype,
    seed: int,
    device: str = "cpu",
) -> Pairs:
    """Sequence i has lens[i] tokens, the first prompts[i] of them its prompt.

    Training packs every sequence into one varlen call, in `order`. Rollout steps through one
    shared paged pool: every request with prompt left extends by up to `chunk` tokens, every
    request past its prompt decodes one token, all in one paged call (a decode step when every
    request in it decodes); each step writes its keys first, then attends. The pairs: each
    sequence's rollout rows against its rows of the training pack.
    """
    packed, paged = ops
    seqs = [qkv(n, seed + 10 * i, dtype, device) for i, n in enumerate(lens)]
    cu = cumulative([lens[i] for i in order])
    train = packed(*(torch.cat([seqs[i][j] for i in order]) for j in range(3)), cu)
    train_rows = {i: train[a:b] for i, (a, b) in zip(order, spans(cu), strict=True)}

    pool = Pool(lens, dtype, seed, device)
    done, outs = [0] * len(lens), [[] for _ in lens]
    while any(d < n for d, n in zip(done, lens, strict=True)):
        step = [(i, d, min(chunk, prompts[i] - d) if d < prompts[i] else 1)
                for i, d in enumerate(done) if d < lens[i]]  # fmt: skip
        for i, d, c in step:
            pool.write(i, d, seqs[i][1][d : d + c], seqs[i][2][d : d + c])
        q = torch.cat([seqs[i][0][d : d + c] for i, d, c in step])
        out = paged(
            q, pool.k, pool.v, cumulative([c for _, _, c in step]),
            [pool.tables[i] for i, _, _ in step], [d + c for _, d, c in step],
            all(d >= prompts[i] for i, d, _ in step),
        )  # fmt: skip
        for (i, _, c), (a, b) in zip(step, spans(cumulative([c for *_, c in step])), strict=True):
            outs[i].append(out[a:b])
            done[i] += c
    return [
        (f"sequence {i} ({n} tokens, prompt {p}, chunk {chunk})", torch.cat(outs[i]), train_rows[i])
        for i, (n, p) in enumerate(zip(lens, prompts, strict=True))
    ]


@st.composite
def schedules(draw, max_len: int, max_seqs: int, max_tail: int, chunks: st.SearchStrategy):
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    prompts = [draw(st.integers(max(1, n - max_tail), n)) for n in lens]
    order = draw(st.permutations(range(len(lens))))
    return lens, prompts, draw(chunks), order


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=30)
@given(
    schedule=schedules(300, 4, 32, st.integers(13, 150)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rollout_steps_equal_the_training_pack(device, schedule, dtype, seed):
    """Up to 4 sequences of up to 300 tokens (several KV blocks), chunks of 13 to 150 tokens
    (mostly not block-aligned), up to 32 decoded tokens each, mixed extend/decode steps."""
    lens, prompts, chunk, order = schedule
    assert_holds(rollout_vs_training(EXACT, lens, prompts, chunk, order, dtype, seed, device))


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=60)
@given(
    schedule=schedules(150, 1, 150, st.integers(1, 70)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_chunked_prefill_and_decode_equal_packed_prefill(device, schedule, dtype, seed):
    """One sequence of up to 150 tokens: any prompt length (down to decoding every token after
    the first), any chunk size from 1."""
    lens, prompts, chunk, order = schedule
    assert_holds(rollout_vs_training(EXACT, lens, prompts, chunk, order, dtype, seed, device))


CONTROL = ([300, 150, 77], [260, 150, 40], 37, [2, 0, 1])
"""Three sequences, 37-token chunks (never block-aligned), decode tails of 40, 0 and 37 tokens,
so steps mix extends and decodes before the last ones decode alone."""


def in_native_ops(ops):
    """The same calls, made inside `K.native_ops()` (per-request SDPA with a position mask)."""

    def wrap(fn):
        def call(*args):
            with K.native_ops():
                return fn(*args)

        return call

    return tuple(wrap(fn) for fn in ops)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_engine_attention_depends_on_chunks_and_decode(device, dtype):
    """SDPA picks its query and key tiles from each call's own lengths, so an extend over a
    chunk's prefix, or a one-query decode, groups the key sums otherwise than the trainer's
    whole-sequence call. On CPU, of the 33,728 outputs: SGLang's torch_native 10,350 (fp32) and
    12 (bf16), the native ops 10,536 and 12 (seeds 12 and 13: about 10,000 in fp32, 6 to 25 in
    bf16); on an H200 3,966 and 14, 4,304 and 14. The exact ops hold on the same schedule."""
    lens, prompts, chunk, order = CONTROL
    with num_threads(2):
        assert_holds(rollout_vs_training(EXACT, lens, prompts, chunk, order, dtype, 11, device))
        for plain, ops in (("sglang_torch_native", SGLANG), ("native_ops", in_native_ops(EXACT))):
            got = rollout_vs_training(ops, lens, prompts, chunk, order, dtype, 11, device)
            differ, total, lines = count_broken(got)
            assert differ > 0, f"{plain} held on {total} outputs: {lines}"


# --- head split -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4])
def test_head_parallel_split_is_exact(device, dtype, tp):
    """TP splits heads (kv groups with their queries); a head's math never sees other heads."""
    hq, hkv, cu = 8, 4, [0, 37, 300]
    q, k, v = qkv(300, 7, dtype, device, hq, hkv)
    full = K.attention(q, k, v, cu)
    per_q, per_kv = hq // tp, hkv // tp
    parts = []
    for r in range(tp):
        hs, kvs = slice(r * per_q, (r + 1) * per_q), slice(r * per_kv, (r + 1) * per_kv)
        parts.append(K.attention(q[:, hs], k[:, kvs], v[:, kvs], cu))
    assert_bitwise(torch.cat(parts, dim=1), full, f"{tp} head shards vs all heads")


@pytest.mark.parametrize("device", DEVICES)
def test_matches_sdpa_within_tolerance(device):
    q, k, v = qkv(100, 3, torch.float32, device)
    ref = sdpa(q, k, v, causal=True)
    torch.testing.assert_close(K.attention(q, k, v, [0, 100]), ref, rtol=1e-5, atol=1e-5)


# --- backward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_sdpa_autograd(device):
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in qkv(65, 21, torch.float32, device))
    g = torch.randn(65, HQ, D).to(device)
    (K.attention(q, k, v, [0, 20, 65]) * g).sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.cat([sdpa(qr[:20], kr[:20], vr[:20], True), sdpa(qr[20:], kr[20:], vr[20:], True)])
    (ref * g).sum().backward()
    for ours, theirs in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
