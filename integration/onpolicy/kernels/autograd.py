"""Exact forward, native backward: the value comes from the exact op, the gradient from the
ordinary torch op recomputed in backward. Only the forward has to be reproducible.

Also the autograd wrapper of an exact fp32 matmul that every backend's linear shares."""

from __future__ import annotations

from collections.abc import Callable

import torch

from onpolicy.kernels.rules import check_segments

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
