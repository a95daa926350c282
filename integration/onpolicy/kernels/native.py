"""The plain torch ops an engine runs by default: the baseline that benchmarks and negative
controls compare against. Fast (cuBLAS/MKL, SDPA, torch reductions) and *not* invariant: their
bits may change with the batch, the chunking or the kernel torch picks.

`kernels.native_ops()` routes every op here, on any device. Same primitive names (`__all__`),
signatures and meaning as the exact backends' `ops`; the arithmetic is what HF transformers
does (rounding to the input dtype where it does), so a model run under `native_ops()` is the
usual HF/torch forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from onpolicy.kernels import compose
from onpolicy.kernels.compose import (
    PagedBatch,
    kv_store,  # a copy: no arithmetic
    merge_expert_parallel,  # a selection: no arithmetic
    scale_logits,
    shard_segments,
    spans,
)
from onpolicy.kernels.cpu.noise import uniform_noise  # integer arithmetic: the one answer
from onpolicy.kernels.rules import check_segments

__all__ = [
    "attention", "combine", "embedding", "expert_outputs", "kv_store", "linear", "linear_partial",
    "log_softmax", "merge_expert_parallel", "moe", "paged_attention", "qk_norm_rope",
    "rms_norm", "rope", "route", "row_parallel_linear", "silu_mul", "sumexp_partial",
    "token_logprobs", "uniform_noise", "vocab_parallel_token_logprobs",
]  # fmt: skip


# --- matmul -----------------------------------------------------------------------------------
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, segments: int = 1
) -> torch.Tensor:
    """One GEMM whatever `segments` (checked, not used)."""
    check_segments(x.shape[-1], segments)
    return F.linear(x, weight, bias)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """fp32, unrounded, no bias (one fp32 GEMM)."""
    check_segments(x.shape[-1], segments)
    return F.linear(x.float(), weight.float())


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, tp: int, bias: torch.Tensor | None = None,
    segments: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each shard's GEMM in x's dtype, summed (an all-reduce), then the bias."""
    k = x.shape[-1]
    shard_segments(k, tp, segments)
    s = k // tp
    out = torch.stack([F.linear(x[..., i * s : (i + 1) * s], weight[:, i * s : (i + 1) * s])
                       for i in range(tp)]).sum(0)  # fmt: skip
    return out if bias is None else out + bias


# --- norms, rotary, activations ---------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3RMSNorm; with `residual`, (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * y.to(x.dtype)
    return out if residual is None else (out, x)


def rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb: cos/sin cast to x's dtype, rotate_half, in x's dtype."""
    half = x.shape[-1] // 2
    rows = table[positions][:, None, :].to(x.dtype)
    cos, sin = rows[..., :half].repeat(1, 1, 2), rows[..., half:].repeat(1, 1, 2)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(q, k, q_weight, k_weight, eps, positions, table):
    """HF Qwen3Attention's q_norm/k_norm, then apply_rotary_pos_emb."""
    return compose.qk_norm_rope(rms_norm, rope, q, k, q_weight, k_weight, eps, positions, table)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


# --- attention --------------------------------------------------------------------------------
def _sdpa(q, k, v, scale, *, causal=False, mask=None) -> torch.Tensor:
    """q [Tq, Hq, D], k, v [Tk, Hkv, D] of one sequence -> [Tq, Hq, D], GQA by SDPA."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=True)  # fmt: skip
    return o[0].transpose(0, 1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal SDPA per packed sequence."""
    outs = [_sdpa(q[a:b], k[a:b], v[a:b], scale, causal=True) for a, b in spans(cu_seqlens)]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: PagedBatch,
    scale: float | None = None,
) -> torch.Tensor:
    """Per request: gather its keys from the pages, SDPA with a mask for the new tokens'
    positions (kv_len - n_new .. kv_len - 1); one new token sees every key, so no mask."""
    outs = []
    for (a, b), table, n in zip(spans(batch.cu_seqlens_q), batch.page_tables, batch.kv_lens,
                                strict=True):  # fmt: skip
        pages = math.ceil(n / k_pages.shape[1])
        k = k_pages[table[:pages]].flatten(0, 1)[:n]
        v = v_pages[table[:pages]].flatten(0, 1)[:n]
        mask = None
        if b - a > 1:
            q_pos = torch.arange(n - (b - a), n, device=q.device)
            mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        outs.append(_sdpa(q[a:b], k, v, scale, mask=mask))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


# --- log-probs --------------------------------------------------------------------------------
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    lp = log_softmax(scale_logits(logits, temperature))
    return lp.gather(-1, tokens[..., None].long())[..., 0]


def sumexp_partial(shard: torch.Tensor, vmax: torch.Tensor, n_segments: int) -> torch.Tensor:
    """torch's sum of exp(shard - vmax) over the shard in one reduction, whatever `n_segments`."""
    return torch.exp(shard.float() - vmax[..., None]).sum(-1)


def vocab_parallel_token_logprobs(
    shards: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The shards gathered into the full logits, then `token_logprobs`."""
    return token_logprobs(torch.cat(list(shards), dim=-1), tokens, temperature)


# --- MoE --------------------------------------------------------------------------------------
def route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF router: fp32 softmax, torch.topk (ties broken however the kernel breaks them)."""
    probs = torch.softmax(F.linear(x, gate_weight).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def _by_expert(topk_ids: torch.Tensor, n_experts: int, experts: Sequence[int] | None = None):
    """(expert, token rows, slots) of every expert in `experts` that has tokens, in expert order;
    one host sync for the whole loop (the tokens' counts per expert)."""
    k, flat = topk_ids.shape[1], topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=n_experts).cumsum(0).tolist()
    wanted = set(range(n_experts) if experts is None else experts)
    for e, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if hi > lo and e in wanted:
            sel = order[lo:hi]
            yield e, sel // k, sel % k


def _swiglu(x, w_gate, w_up, w_down) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    local_experts: Sequence[int] | None = None,
    segments: int = 1,
) -> torch.Tensor:
    check_segments(w_down.shape[-1], segments)
    out = x.new_zeros(*topk_ids.shape, w_down.shape[1])
    for e, tok, slot in _by_expert(topk_ids, w_gate.shape[0], local_experts):
        out[tok, slot] = _swiglu(x[tok], w_gate[e], w_up[e], w_down[e])
    return out


def combine(
    outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """sum over slots of weight * output, in outputs' dtype."""
    return (outputs * topk_weights[..., None].to(outputs.dtype)).sum(dim=1)


def moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    segments: int = 1,
) -> torch.Tensor:
    """HF Qwen3MoeSparseMoeBlock: expert by expert, weighted outputs index_add-ed into place."""
    check_segments(w_down.shape[-1], segments)
    ids, weights = route(x, gate_weight, top_k, renormalize)
    out = torch.zeros_like(x)
    for e, tok, slot in _by_expert(ids, w_gate.shape[0]):
        y = _swiglu(x[tok], w_gate[e], w_up[e], w_down[e])
        out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out
