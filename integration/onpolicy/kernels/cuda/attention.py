"""Exact causal GQA attention (CUDA): one kernel for packed prefill, chunked prefill over a
paged cache, and decode.

A program owns one KV head and BLOCK_M query rows, a row being one (token, query head of that
KV head's group) pair, so decode packs the group's heads into one tile just as prefill packs
tokens. Keys are folded in KV_BLOCK-wide blocks from position 0 upwards, per row:
1. s = q . k by one tensor-core product over head_dim, times scale, fp32; keys past the row's
   position are -inf;
2. m' = max(m, max s); a = exp(m - m'); p = exp(s - m');
3. l' = l * a + sum(p); acc' = acc * a + p . v (p rounded to v's dtype for the product);
4. a block holding no key <= the row's position leaves (m, l, acc) untouched;
5. out = acc / l, rounded once.
The tile shape is fixed, rows never mix inside a product, and a row's keys are the same block
for block whether they come from the packed tensor or from pages; so a token's output does not
depend on the batch, the chunking, or prefill vs decode. The KV is never split across programs
(see docs/exactness.md for what that costs decode at small batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from onpolicy.kernels.cpu.attention import _scale, _spans, varlen_with_native_grad
from onpolicy.kernels.rules import KV_BLOCK

BLOCK_M, NUM_WARPS, NUM_STAGES = 64, 4, 2
"""The one tile configuration: 64 (token, head) rows per program, one KV head."""

_UNPAGED = 1 << 30
"""Page size that makes a packed [T, Hkv, D] tensor one page per sequence."""


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tile_req_ptr, tile_row_ptr, q_start_ptr, n_new_ptr, kv_len_ptr,
    kv_base_ptr, pages_ptr, stride_pages, page_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid, kvh = tl.program_id(0), tl.program_id(1)
    req = tl.load(tile_req_ptr + pid)
    f0 = tl.load(tile_row_ptr + pid)
    q0 = tl.load(q_start_ptr + req)
    n_new = tl.load(n_new_ptr + req)
    kv_len = tl.load(kv_len_ptr + req)
    kv_base = tl.load(kv_base_ptr + req)
    f = f0 + tl.arange(0, BM)
    tok, head = f // G, f % G
    row_ok = tok < n_new
    q_pos = kv_len - n_new + tok
    d = tl.arange(0, D)
    q_rows = (q0 + tok).to(tl.int64) * stride_qt + (kvh * G + head) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    last_tok = tl.minimum((f0 + BM - 1) // G, n_new - 1)
    hi = kv_len - n_new + last_tok + 1
    m = tl.full((BM,), float("-inf"), tl.float32)
    denom = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for lo in range(0, hi, BN):
        kp = lo + tl.arange(0, BN)
        kp_ok = kp < kv_len
        page = tl.load(pages_ptr + req * stride_pages + kp // page_size, mask=kp_ok, other=0)
        row = (kv_base + page.to(tl.int64) * page_size + kp % page_size).to(tl.int64)
        kt = tl.load(k_ptr + row[None, :] * stride_kt + kvh * stride_kh + d[:, None],
                     mask=kp_ok[None, :], other=0.0)  # fmt: skip
        vb = tl.load(v_ptr + row[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                     mask=kp_ok[:, None], other=0.0)  # fmt: skip
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee") * scale
        else:
            s = tl.dot(q, kt) * scale
        valid = (kp[None, :] <= q_pos[:, None]) & row_ok[:, None]
        s = tl.where(valid, s, float("-inf"))
        live = (q_pos >= lo) & row_ok
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(live, m_new, 0.0)
        alpha = tl.exp(m - m_use)
        p = tl.where(valid, tl.exp(s - m_use[:, None]), 0.0)
        denom_new = denom * alpha + tl.sum(p, 1)
        if IEEE:
            acc_new = tl.dot(p, vb, acc * alpha[:, None], input_precision="ieee")
        else:
            acc_new = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None])
        m = tl.where(live, m_new, m)
        denom = tl.where(live, denom_new, denom)
        acc = tl.where(live[:, None], acc_new, acc)
    out = acc / denom[:, None]
    o_rows = (q0 + tok).to(tl.int64) * stride_ot + (kvh * G + head) * stride_oh
    tl.store(o_ptr + o_rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip


def _launch(q, k_rows, v_rows, q_starts, n_new, kv_lens, kv_base, pages, page_size, scale):
    """q [T, Hq, D]; k_rows, v_rows [rows, Hkv, D]; per-request lists; pages [R, P] on device."""
    t, hq, d = q.shape
    hkv = k_rows.shape[1]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads is not a multiple of {hkv} kv heads")
    if d < 16 or d & (d - 1):
        raise ValueError(f"attention: head_dim {d} must be a power of 2 >= 16 on CUDA")
    for n, kv in zip(n_new, kv_lens, strict=True):
        if n > kv:
            raise ValueError(f"attention: {n} new tokens but only {kv} keys in the cache")
    g = hq // hkv
    out = torch.empty_like(q)
    tile_req, tile_row = [], []
    for i, n in enumerate(n_new):
        starts = range(0, n * g, BLOCK_M)
        tile_req += [i] * len(starts)
        tile_row += list(starts)
    if not tile_req:
        return out
    dev = q.device

    def ints(xs):
        return torch.tensor(xs, dtype=torch.int64, device=dev)

    _attn_kernel[(len(tile_req), hkv)](
        q, k_rows, v_rows, out, ints(tile_req), ints(tile_row), ints(q_starts), ints(n_new),
        ints(kv_lens), ints(kv_base), pages, pages.stride(0), page_size,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1),
        v_rows.stride(0), v_rows.stride(1), out.stride(0), out.stride(1),
        scale, G=g, D=d, BM=BLOCK_M, BN=KV_BLOCK, IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _varlen_exact(q, k, v, cu_seqlens, scale):
    spans = _spans(cu_seqlens)
    lens = [b - a for a, b in spans]
    pages = torch.zeros(len(spans), 1, dtype=torch.int64, device=q.device)
    starts = [a for a, _ in spans]
    return _launch(_rows(q), _rows(k), _rows(v), starts, lens, lens, starts, pages, _UNPAGED, scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention over packed sequences: q [T, Hq, D], k, v [T, Hkv, D]; the gradient is
    the native SDPA's."""
    return varlen_with_native_grad(_varlen_exact, q, k, v, cu_seqlens, scale)


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Sequence[int],
    page_tables: Sequence[torch.Tensor],
    kv_lens: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over a paged cache [num_pages, page_size, Hkv, D]; the
    new tokens of request i sit at positions kv_lens[i] - n_new .. kv_lens[i] - 1."""
    spans = _spans(cu_seqlens_q)
    if not spans:
        return q.new_zeros(q.shape)
    num_pages, page_size, hkv, d = k_pages.shape
    k_rows = k_pages.reshape(num_pages * page_size, hkv, d)
    v_rows = v_pages.reshape(num_pages * page_size, hkv, d)
    kv_lens = [int(n) for n in kv_lens]
    tables = [torch.as_tensor(t, device=q.device).long() for t in page_tables]
    pages = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    if pages.shape[1] == 0:
        pages = torch.zeros(len(spans), 1, dtype=torch.int64, device=q.device)
    for i, (t, n) in enumerate(zip(tables, kv_lens, strict=True)):
        if t.numel() * page_size < n:
            raise ValueError(f"paged_attention: request {i} has {n} keys but {t.numel()} pages")
    return _launch(
        _rows(q), k_rows, v_rows, [a for a, _ in spans], [b - a for a, b in spans], kv_lens,
        [0] * len(spans), pages, page_size, _scale(q, scale),
    )  # fmt: skip
