"""Exact ops: the forward bits of a token depend only on the token, its position and its
sequence, never on the batch, the chunking, prefill vs decode, or a power-of-2 TP split.

One API; the backend is picked by the device of the first tensor argument: `kernels/cpu/`
(pure torch, every sum spelled out) for CPU tensors, `kernels/cuda/` (Triton kernels) for CUDA
tensors; other devices raise NotImplementedError naming the op. Each backend's `ops` module
exports the same flat primitive names, and `_OPS` maps every public op to one of them; what
the backends share (the row-parallel linear, the MoE block, the vocab-parallel log-probs, the
torch router and combine) is written once in `compose`. The reduction layouts in `rules` bind
every backend; exactness is required within one backend, not across backends.
docs/exactness.md has each op's reduction order and the test that proves it.

`native_ops()` swaps in the plain torch ops (cuBLAS, SDPA, torch reductions) on any device: the
baseline that benchmarks and negative controls compare against, never exact. `kernels.native`
exports the same primitive names.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch

from onpolicy.kernels import compose
from onpolicy.kernels.autograd import exact_with_native_grad
from onpolicy.kernels.cpu.rope import rope_table as _rope_table
from onpolicy.kernels.rules import (
    K_BLOCK,
    KV_BLOCK,
    VOCAB_SEGMENTS,
    k_segments,
    row_parallel_exact,
    vocab_parallel_exact,
    vocab_segments,
)
from onpolicy.kernels.tree import combine_partials, pairwise_tree_sum, tree_sum

_OPS: dict[str, str] = {
    "linear": "linear",
    "linear_partial": "linear_partial",
    "row_parallel_linear": "row_parallel_linear",
    "rms_norm": "rms_norm",
    "rope": "rope",
    "qk_norm_rope": "qk_norm_rope",
    "silu_mul": "silu_mul",
    "embedding": "embedding",
    "attention": "attention",
    "paged_attention": "paged_attention",
    "kv_store": "kv_store",
    "log_softmax": "log_softmax",
    "token_logprobs": "token_logprobs",
    "vocab_parallel_token_logprobs": "vocab_parallel_token_logprobs",
    "sumexp_partial": "sumexp_partial",
    "moe_route": "route",
    "moe_expert_outputs": "expert_outputs",
    "moe_merge_expert_parallel": "merge_expert_parallel",
    "moe_combine": "combine",
    "moe": "moe",
    "uniform_noise": "uniform_noise",
}
"""Public op -> the primitive name every backend's surface exports (`__all__` of `cpu/ops.py`,
`cuda/ops.py` and `native.py`)."""

_BACKENDS: dict[str, str] = {
    "cpu": "onpolicy.kernels.cpu.ops",
    "cuda": "onpolicy.kernels.cuda.ops",
}
"""Device type -> its backend's surface, imported on first use (Triton is only needed where
there is a GPU)."""

_loaded: dict[str, ModuleType] = {}
"""Device type -> its imported surface."""

_native: list[ModuleType] = []
"""Non-empty inside `native_ops()`: every op resolves to onpolicy.kernels.native."""


def _surface(op: str, device_type: str) -> ModuleType:
    if _native:
        return _native[-1]
    if device_type not in _loaded:
        if device_type not in _BACKENDS:
            raise NotImplementedError(
                f"onpolicy.kernels.{op}: no exact backend for device {device_type!r} "
                f"(implemented: {', '.join(sorted(_BACKENDS))})"
            )
        _loaded[device_type] = importlib.import_module(_BACKENDS[device_type])
    return _loaded[device_type]


def _impl(op: str, t: torch.Tensor) -> Callable:
    """The implementation of public op `op` for tensors on t's device."""
    surface = _surface(op, t.device.type)
    fn = getattr(surface, _OPS[op], None)
    if fn is None:
        raise NotImplementedError(
            f"onpolicy.kernels.{op}: {surface.__name__} (device {t.device.type!r}) has no "
            f"{_OPS[op]!r}"
        )
    return fn


@contextlib.contextmanager
def native_ops() -> Iterator[None]:
    """Inside, every op is the plain torch op on the tensor's device: fast, not invariant."""
    _native.append(importlib.import_module("onpolicy.kernels.native"))
    try:
        yield
    finally:
        _native.pop()


# --- matmul -----------------------------------------------------------------------------------
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, segments: int = 1
) -> torch.Tensor:
    """x @ weight.T (+ bias), weight [N, K]; K in `segments` equal segments (`k_segments`),
    each in the backend's fixed order, the segments by the pairwise tree; fp32 acc."""
    return _impl("linear", x)(x, weight, bias, segments)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, *, segments: int = 1) -> torch.Tensor:
    """fp32 sum over this (shard of) K only, in `segments` segments: no bias, not rounded; feed
    `combine_partials`. A row-parallel rank passes its share, S / tp."""
    return _impl("linear_partial", x)(x, weight, segments)


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, tp: int, bias: torch.Tensor | None = None, *,
    segments: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`tp` row-parallel shards of a K in `segments` segments (default tp) plus the tree
    combine, in one process."""
    return _impl("row_parallel_linear", x)(x, weight, tp, bias, segments)


# --- norms, rotary, activations ---------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, fp32 math; with `residual` returns (normed, x + residual)."""
    return _impl("rms_norm", x)(x, weight, eps, residual)


def rope_table(head_dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """fp32 [max_positions, head_dim] cos|sin table, built once per model (on CPU)."""
    return _rope_table(head_dim, theta, max_positions)


def rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of x [T, heads, head_dim] at `positions` [T], fp32 math."""
    return _impl("rope", x)(x, positions, table)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    positions: torch.Tensor, table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Qwen3's per-head RMSNorm of q [T, Hq, D] and k [T, Hkv, D], then neox RoPE: the bits of
    `rope(rms_norm(.))` of each, in fewer launches where the backend fuses them."""
    return _impl("qk_norm_rope", q)(q, k, q_weight, k_weight, eps, positions, table)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once."""
    return _impl("silu_mul", gate)(gate, up)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of weight [V, H] at ids."""
    return _impl("embedding", weight)(ids, weight)


# --- attention --------------------------------------------------------------------------------
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention over packed sequences (varlen prefill)."""
    return _impl("attention", q)(q, k, v, cu_seqlens, scale)


PagedBatch = compose.PagedBatch
"""One forward's paged-attention batch (offsets, page tables, key counts), shared by its layers."""


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: PagedBatch,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of new tokens over a paged KV cache (chunked prefill, decode)."""
    return _impl("paged_attention", q)(q, k_pages, v_pages, batch, scale)


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:  # fmt: skip
    """Write rows k, v [n, kv_heads, head_dim] into k_cache, v_cache [slots, kv_heads, head_dim]
    at `slots` (a paged cache's page * page_size + offset), in place: a copy, so the cache holds
    the rows' own bits on every backend (on CUDA one launch for both)."""
    _impl("kv_store", k)(k_cache, v_cache, slots, k, v)


# --- log-probs --------------------------------------------------------------------------------
scale_logits = compose.scale_logits
"""logits / temperature rounded to the logits' dtype, untouched at 1 (elementwise, any device)."""


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim in the fixed segment-tree order."""
    return _impl("log_softmax", x)(x)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """fp32 log p(tokens) under log_softmax(logits / temperature), as SGLang computes it."""
    return _impl("token_logprobs", logits)(logits, tokens, temperature)


def vocab_parallel_token_logprobs(
    shards: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """`token_logprobs` from vocab-parallel logit shards; equal to the full one bit for bit."""
    return _impl("vocab_parallel_token_logprobs", shards[0])(shards, tokens, temperature)


def sumexp_partial(shard: torch.Tensor, vmax: torch.Tensor, n_segments: int) -> torch.Tensor:
    """One vocab-parallel rank's share of the log-softmax sum: exp(shard - vmax) over its
    `n_segments` whole segments, tree-summed, fp32. `vmax` is the full-vocab max; the ranks'
    shares combined by the pairwise tree in rank order are the full sum bit for bit. The
    gradient is that of torch's exp-sum (vmax is a constant)."""
    exact = _impl("sumexp_partial", shard)
    vmax = vmax.detach()
    return exact_with_native_grad(
        lambda s: exact(s, vmax, n_segments),
        lambda s: torch.exp(s.float() - vmax[..., None]).sum(-1),
        shard,
    )


def uniform_noise(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] fp32 uniforms in (0, 1), row r a keyed 32-bit hash of each column with the two
    words of words[r] ([R, 2] int64, each below 2^32): the same bits on every backend. The
    sampling rule's noise (`models.sampling`)."""
    return _impl("uniform_noise", words)(words, vocab)


# --- MoE --------------------------------------------------------------------------------------
def moe_route(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids, fp32 topk_weights): fp32 softmax, stable top-k (ties to lower id)."""
    return _impl("moe_route", x)(x, gate_weight, top_k, renormalize)


def moe_expert_outputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    local_experts: Sequence[int] | None = None,
    *,
    segments: int = 1,
) -> torch.Tensor:
    """[T, k, H] per-(token, slot) SwiGLU outputs for the experts in `local_experts`; the down
    projection's K (the expert's intermediate size) in `segments` segments."""
    return _impl("moe_expert_outputs", x)(
        x, topk_ids, w_gate, w_up, w_down, local_experts, segments
    )


def moe_merge_expert_parallel(
    per_rank: Sequence[torch.Tensor], topk_ids: torch.Tensor, owner: torch.Tensor
) -> torch.Tensor:
    """Each (token, slot) output taken from the rank owning its expert (`owner[e]` = rank)."""
    return _impl("moe_merge_expert_parallel", topk_ids)(per_rank, topk_ids, owner)


def moe_combine(
    outputs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Weighted sum of a token's slot outputs in ascending expert-id order (fp32 tree)."""
    return _impl("moe_combine", outputs)(outputs, topk_ids, topk_weights)


def moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    *,
    segments: int = 1,
) -> torch.Tensor:
    """The sparse MoE block: route, every expert (down projection in `segments`), combine."""
    return _impl("moe", x)(x, gate_weight, w_gate, w_up, w_down, top_k, renormalize, segments)


__all__ = [
    "K_BLOCK", "KV_BLOCK", "VOCAB_SEGMENTS", "PagedBatch", "attention", "combine_partials",
    "embedding",
    "k_segments", "kv_store", "linear", "linear_partial", "log_softmax", "moe", "moe_combine",
    "moe_expert_outputs",
    "moe_merge_expert_parallel", "moe_route", "native_ops", "paged_attention", "pairwise_tree_sum",
    "qk_norm_rope",
    "rms_norm", "rope", "rope_table", "row_parallel_exact", "row_parallel_linear",
    "scale_logits", "silu_mul", "sumexp_partial", "token_logprobs", "tree_sum", "uniform_noise",
    "vocab_parallel_exact", "vocab_parallel_token_logprobs", "vocab_segments",
]  # fmt: skip
