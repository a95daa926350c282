"""Exact forward, native backward: the value comes from the exact op, the gradient from the
ordinary torch op recomputed in backward. Only the forward has to be reproducible.

Also the pieces of the linear every backend shares: the autograd wrapper of an exact fp32
matmul, and the row-parallel composition of shard partials."""

from __future__ import annotations

from collections.abc import Callable

import torch

from onpolicy.kernels.rules import check_segments
from onpolicy.kernels.tree import combine_partials

Matmul = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""An exact x [M, K] @ w [N, K].T -> fp32 [M, N] with K cut into the given number of
segments (`rules.k_segments`): the backend's own kernel."""


class _ExactForwardNativeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exact_fn: Callable, native_fn: Callable, *inputs: torch.Tensor):
        ctx.native_fn = native_fn
        ctx.save_for_backward(*inputs)
        return exact_fn(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.native_fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        got = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return None, None, *(next(got) if t.requires_grad else None for t in inputs)


def exact_with_native_grad(
    exact_fn: Callable[..., torch.Tensor],
    native_fn: Callable[..., torch.Tensor],
    *inputs: torch.Tensor,
) -> torch.Tensor:
    """exact_fn(*inputs) as the value, with native_fn's gradient (both take the same tensors)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _ExactForwardNativeBackward.apply(exact_fn, native_fn, *inputs)
    return exact_fn(*inputs)


class _LinearPartial(torch.autograd.Function):
    """Exact fp32 forward by the backend's matmul; the native matmul gradient backward."""

    @staticmethod
    def forward(
        ctx, matmul: Matmul, x: torch.Tensor, weight: torch.Tensor, segments: int
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        return matmul(flat, weight, segments).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = None
        if ctx.needs_input_grad[1]:
            gx = (g @ weight.float()).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[2]:
            gw = (g.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        return None, gx, gw, None


def linear_partial(
    matmul: Matmul, x: torch.Tensor, weight: torch.Tensor, segments: int = 1
) -> torch.Tensor:
    """fp32 x @ weight.T over this weight's K by `matmul`, K in `segments` equal segments: no
    bias, not rounded."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]}, weight [N, K] has K={weight.shape[-1]}")
    check_segments(x.shape[-1], segments)
    return _LinearPartial.apply(matmul, x, weight, segments)


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
    partial: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, tp: int,
    bias: torch.Tensor | None, segments: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`tp` contiguous K-shards' `partial`s combined by the tree, in one process; K holds
    `segments` segments in all (default `tp`), so each shard holds segments / tp of them."""
    k = x.shape[-1]
    per = shard_segments(k, tp, segments)
    s = k // tp
    parts = [partial(x[..., i * s : (i + 1) * s], weight[:, i * s : (i + 1) * s], per)
             for i in range(tp)]  # fmt: skip
    return combine_partials(parts, x.dtype, bias)
