"""Exact forward, native backward: the value comes from the exact op, the gradient from the
ordinary torch op recomputed in backward. Only the forward has to be reproducible."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
