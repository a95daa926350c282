"""What every exact backend shares, written once above the backends.

Two kinds of pieces:
- compositions of a backend's primitives, which take those primitives as their first
  arguments and are bound by each backend's `ops` module: the row-parallel linear (shard
  partials, the tree combine), the MoE block (route, experts, combine), the vocab-parallel
  log-probs (max, each shard's `sumexp_partial`, the tree);
- torch code that is exact on any device, used as a backend's primitive or as the fallback
  where a backend has no kernel for a shape: the router after its linear, the combine in
  expert-id order, the expert-parallel merge (a selection), temperature scaling, and the
  attention scale and packed-attention gradient.
Everything here is moved from the CPU backend, where it was first written, arithmetic
untouched: a backend's bits are what they were.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.rules import check_segments, vocab_parallel_exact, vocab_segments
from onpolicy.kernels.tree import combine_partials, pairwise_tree_sum, tree_sum

SumExp = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(x [..., W] fp32, full-vocab max [...], segments) -> the tree sum of exp(x - max) over
x's segments: the one piece of the log-softmax each backend computes its own way."""


# --- linear -----------------------------------------------------------------------------------
def shard_segments(k: int, tp: int, segments: int | None) -> int:
    """Segments per shard when a K = `k` of `segments` segments (default `tp`: one a shard) is
    cut into `tp` shards; refuses a cut that splits a segment."""
    segments = tp if segments is None else segments
    if tp < 1 or k % tp:
        raise ValueError(f"row_parallel_linear: K={k} does not split into {tp} equal shards")
    check_segments(k, segments)
    if segments % tp:
        raise ValueError(
            f"row_parallel_linear: {tp} shards of K={k} would split its {segments} segments "
            "(rules.row_parallel_exact: tp must divide the segment count)"
        )
    return segments // tp


def row_parallel_linear(
    linear_partial: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, tp: int,
    bias: torch.Tensor | None = None, segments: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`tp` contiguous K-shards' `linear_partial`s combined by the tree, in one process: what
    `tp` ranks plus the tree all-reduce compute. K holds `segments` segments in all (default
    `tp`), so each shard holds segments / tp of them."""
    k = x.shape[-1]
    per = shard_segments(k, tp, segments)
    s = k // tp
    parts = [linear_partial(x[..., i * s : (i + 1) * s], weight[:, i * s : (i + 1) * s], per)
             for i in range(tp)]  # fmt: skip
    return combine_partials(parts, x.dtype, bias)


# --- attention --------------------------------------------------------------------------------
def attention_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


@dataclasses.dataclass(eq=False)
class PagedBatch:
    """One forward's batch for `paged_attention`, built once and passed to every layer.

    Request i owns the new tokens (query rows) cu_seqlens_q[i]:cu_seqlens_q[i+1]; its cache
    holds kv_lens[i] keys, at page_tables[i], the new tokens' keys last. Lists are read on the
    host and checked; CUDA tensors are never read back (a decode step with no host sync), so
    keeping them consistent is the caller's. A backend keeps what it derives from the batch in
    `derived` (the CUDA backend: its launch schedule), so only the first layer derives it:
    build a new batch for each forward, inside the CUDA graph when the forward is captured.
    """

    cu_seqlens_q: torch.Tensor | Sequence[int]
    """[requests + 1] offsets of each request's new tokens in q."""
    page_tables: torch.Tensor | Sequence[torch.Tensor]
    """Each request's pages: one [requests, pages] tensor, or one tensor a request."""
    kv_lens: torch.Tensor | Sequence[int]
    """[requests] keys in each request's cache."""
    derived: dict = dataclasses.field(default_factory=dict, repr=False)
    """What backends derived from the batch, keyed by what else it depends on."""


def spans(cu_seqlens: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence, read on the host."""
    cu = [int(c) for c in cu_seqlens]
    return list(zip(cu[:-1], cu[1:], strict=True))


def _varlen_native(q, k, v, cu_seqlens, scale):
    g = q.shape[1] // k.shape[1]
    outs = []
    for a, b in spans(cu_seqlens):
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1).to(q.dtype))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def varlen_with_native_grad(exact_varlen, q, k, v, cu_seqlens, scale):
    """`exact_varlen(q, k, v, cu_seqlens, scale)` as the value, per-sequence SDPA's gradient:
    the packed-attention entry point of every backend."""
    sc = attention_scale(q, scale)
    return exact_with_native_grad(
        lambda q_, k_, v_: exact_varlen(q_, k_, v_, cu_seqlens, sc),
        lambda q_, k_, v_: _varlen_native(q_, k_, v_, cu_seqlens, sc),
        q, k, v,
    )  # fmt: skip


def check_kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:  # fmt: skip
    """Refuse a KV store whose shapes, devices or dtypes disagree, naming them."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"kv_store: k {tuple(k.shape)} and v {tuple(v.shape)} must be one "
                         "[rows, kv_heads, head_dim] shape")  # fmt: skip
    if k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"kv_store: caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)} "
                         f"must both be [slots, {k.shape[1]}, {k.shape[2]}] for rows "
                         f"{tuple(k.shape)}")  # fmt: skip
    if slots.shape != k.shape[:1] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_store: slots {tuple(slots.shape)} {slots.dtype} must be one int32 "
                         f"or int64 slot per row ({k.shape[0]} rows)")  # fmt: skip
    if (k_cache.dtype, v_cache.dtype) != (k.dtype, v.dtype):
        raise ValueError(f"kv_store: rows {k.dtype}/{v.dtype} into caches "
                         f"{k_cache.dtype}/{v_cache.dtype}: a store does not convert")  # fmt: skip
    if len({t.device for t in (k_cache, v_cache, slots, k, v)}) != 1:
        raise ValueError("kv_store: caches, slots and rows must be on one device")


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:  # fmt: skip
    """k_cache[slots] = k and v_cache[slots] = v: one `index_copy_` each (torch refuses a slot
    out of range)."""
    check_kv_store(k_cache, v_cache, slots, k, v)
    index = slots.long()
    k_cache.index_copy_(0, index, k)
    v_cache.index_copy_(0, index, v)


# --- norms and rotary -------------------------------------------------------------------------
def qk_norm_rope(
    rms_norm: Callable, rope: Callable, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, positions: torch.Tensor, table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A backend's rms_norm then rope of each head of q and of k."""
    return (rope(rms_norm(q, q_weight, eps), positions, table),
            rope(rms_norm(k, k_weight, eps), positions, table))  # fmt: skip


# --- activations ------------------------------------------------------------------------------
def silu_mul_native(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu's silu(gate) * up in fp32, rounded to gate's dtype: the gradient every backend's
    exact silu_mul takes."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


# --- log-probs --------------------------------------------------------------------------------
def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature rounded to the logits' dtype; untouched when the temperature is 1."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if temperature == 1.0:
        return logits
    return (logits.float() / temperature).to(logits.dtype)


def logsumexp(sumexp: SumExp, xf: torch.Tensor) -> torch.Tensor:
    """fp32 log-sum-exp over the last dim: max, then the backend's segment sums (`sumexp`)
    combined by the tree."""
    vmax = xf.amax(dim=-1).detach()
    return vmax + torch.log(sumexp(xf, vmax, vocab_segments(xf.shape[-1])))


def vocab_parallel_token_logprobs(
    sumexp_partial: SumExp, shards: Sequence[torch.Tensor], tokens: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """`token_logprobs` from the LM head's vocab shards [T, V/tp] (in one process): what tp
    ranks compute with a max all-reduce and a tree all-reduce of the backend's
    `sumexp_partial`.

    Each shard must be a whole number of segments (`rules.vocab_parallel_exact`); then the
    result equals `token_logprobs` on the concatenated logits bit for bit.
    """
    tp = len(shards)
    width = shards[0].shape[-1]
    vocab = width * tp
    if any(s.shape[-1] != width for s in shards) or not vocab_parallel_exact(vocab, tp):
        raise ValueError(
            f"vocab_parallel_token_logprobs: {tp} shards of a {vocab}-wide vocab do not each hold "
            f"whole segments ({vocab_segments(vocab)} segments); use tp dividing that count"
        )
    xs = [scale_logits(s, temperature).float() for s in shards]
    vmax = torch.stack([x.amax(dim=-1) for x in xs]).amax(dim=0).detach()
    per_shard = vocab_segments(vocab) // tp
    total = pairwise_tree_sum([sumexp_partial(x, vmax, per_shard) for x in xs])
    lse = vmax + torch.log(total)
    tokens = tokens.to(xs[0].device).long()
    owner, local = tokens // width, tokens % width
    picked = torch.stack([x.gather(-1, local[..., None])[..., 0] for x in xs])
    return picked.gather(0, owner[None])[0] - lse


# --- MoE --------------------------------------------------------------------------------------
def route_from_logits(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its linear: elementwise ops, tree sums and a stable sort, exact on any
    device."""
    logits = logits.float()
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True).detach())
    probs = e / tree_sum(e, dim=-1)[..., None]
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = probs.gather(-1, order)
    if renormalize:
        weights = weights / tree_sum(weights, dim=-1)[..., None]
    return order, weights


def merge_expert_parallel(per_rank: Sequence[torch.Tensor], topk_ids: torch.Tensor,
                          owner: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Take each slot from the rank that owns its expert (`owner[e]` = rank of expert e)."""
    stacked = torch.stack(list(per_rank))  # [R, T, k, H]
    pick = owner[topk_ids][None, ..., None].expand(1, *stacked.shape[1:])
    return stacked.gather(0, pick)[0]


def combine(
    outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """sum_slots weight * output in ascending expert-id order, fp32 tree, rounded to outputs'
    dtype. outputs [T, k, H], topk_ids / topk_weights [T, k]."""
    order = torch.sort(topk_ids, dim=-1, stable=True).indices
    y = outputs.gather(1, order[..., None].expand_as(outputs)).float()
    w = topk_weights.gather(1, order).float()
    return pairwise_tree_sum((w[..., None] * y).transpose(0, 1)).to(outputs.dtype)


def moe(
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    expert_outputs: Callable[..., torch.Tensor],
    combine: Callable[..., torch.Tensor],
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    segments: int = 1,
) -> torch.Tensor:
    """The whole sparse MoE block on one rank by a backend's primitives: route, run every
    expert, combine."""
    ids, weights = route(x, gate_weight, top_k, renormalize)
    return combine(expert_outputs(x, ids, w_gate, w_up, w_down, None, segments), ids, weights)
