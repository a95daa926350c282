"""Exact causal GQA attention (CPU): fixed key blocks, one online-softmax arithmetic.

For a query at position p of a sequence, keys are folded in blocks [0, B), [B, 2B), ... in that
order (B = KV_BLOCK), whatever produced them:
1. scores s = tree_sum_d(q * k) * scale in fp32; keys past p (or past the cache) are -inf;
2. m' = max(m, max s); a = exp(m - m'); p = exp(s - m');
3. l' = l * a + tree_sum_b(p); acc' = acc * a + tree_sum_b(p * v), masked terms exactly +0;
4. a block that holds no key <= p leaves (m, l, acc) untouched;
5. out = acc / l, rounded once.
Every step is elementwise or a fixed tree over one query's own data, so packed prefill, chunked
prefill over a paged cache (any chunk size) and one-token decode all produce the same bits: the
only thing that differs between them is which tensor the keys are read from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from onpolicy.kernels.compose import PagedBatch, attention_scale, spans, varlen_with_native_grad
from onpolicy.kernels.rules import K_BLOCK, KV_BLOCK
from onpolicy.kernels.tree import tree_sum


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: q [Tq, Hq, D] at positions q_pos, over keys k, v [Tk, Hkv, D] at 0..Tk-1."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    if tq == 0:
        return q.new_zeros(q.shape)
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {hkv} kv heads")
    last = int(q_pos.max())
    if last >= k.shape[0]:
        raise ValueError(f"attention: query at position {last} but only {k.shape[0]} keys")
    g = hq // hkv
    # The reduced index leads in every product so each tree level is one contiguous add.
    qf = q.float().view(tq, hkv, g, d).permute(3, 0, 1, 2)[..., None]  # [D, Tq, Hkv, G, 1]
    m = q.new_full((tq, hkv, g), -math.inf, dtype=torch.float32)
    denom = q.new_zeros((tq, hkv, g), dtype=torch.float32)
    acc = q.new_zeros((tq, hkv, g, d), dtype=torch.float32)
    for lo in range(0, last + 1, KV_BLOCK):
        kb = k[lo : lo + KV_BLOCK].float()
        vb = v[lo : lo + KV_BLOCK].float()
        if kb.shape[0] < KV_BLOCK:
            pad = (0, 0, 0, 0, 0, KV_BLOCK - kb.shape[0])
            kb, vb = F.pad(kb, pad), F.pad(vb, pad)
        k_pos = torch.arange(lo, lo + KV_BLOCK)
        valid = (k_pos[None, :] <= q_pos[:, None])[:, None, None, :]  # [Tq, 1, 1, B]
        live = (q_pos >= lo)[:, None, None]
        s = tree_sum(qf * kb.permute(2, 1, 0)[:, None, :, None, :], dim=0, block=K_BLOCK) * scale
        s = torch.where(valid, s, -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])  # [Tq, Hkv, G, B]
        pv = p.permute(3, 0, 1, 2)[..., None] * vb[:, None, :, None, :]  # [B, Tq, Hkv, G, D]
        pv = torch.where(valid.permute(3, 0, 1, 2)[..., None], pv, 0.0)
        denom_new = denom * alpha + tree_sum(torch.where(valid, p, 0.0), dim=-1)
        acc_new = acc * alpha[..., None] + tree_sum(pv, dim=0)
        m = torch.where(live, m_new, m)
        denom = torch.where(live, denom_new, denom)
        acc = torch.where(live[..., None], acc_new, acc)
    return (acc / denom[..., None]).reshape(tq, hq, d).to(q.dtype)


def _varlen_exact(q, k, v, cu_seqlens, scale):
    outs = [_attend(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
            for a, b in spans(cu_seqlens)]  # fmt: skip
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k, v [T, Hkv, D].

    Sequence i is rows cu_seqlens[i]:cu_seqlens[i+1], each starting at position 0. The gradient
    is the native SDPA's.
    """
    return varlen_with_native_grad(_varlen_exact, q, k, v, cu_seqlens, scale)


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n positions of one request from a paged cache [num_pages, page_size, ...]."""
    pos = torch.arange(n)
    return pages[page_table[pos // pages.shape[1]], pos % pages.shape[1]]


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: PagedBatch,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over a paged KV cache (chunked prefill and decode).

    Request i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; its cache holds kv_lens[i] keys
    (these new tokens' keys already written, as the last ones), at page_tables[i] of
    k_pages, v_pages [num_pages, page_size, Hkv, D]. The new tokens sit at positions
    kv_lens[i] - n_new .. kv_lens[i] - 1.
    """
    sc = attention_scale(q, scale)
    outs = []
    for (a, b), table, n in zip(spans(batch.cu_seqlens_q), batch.page_tables, batch.kv_lens,
                                strict=True):  # fmt: skip
        k = gather_pages(k_pages, table, n)
        v = gather_pages(v_pages, table, n)
        outs.append(_attend(q[a:b], k, v, torch.arange(n - (b - a), n), sc))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
