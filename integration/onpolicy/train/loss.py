"""PPO-clip policy loss (GRPO style) on per-token log-probs, with an optional KL penalty.

Per token t with mask m_t = 1 (a response token the policy is trained on):
    r_t    = exp(logp_t - old_logp_t)
    pg_t   = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
    kl_t   = k3(logp_t, ref_logp_t) = exp(ref - logp) - (ref - logp) - 1      (when kl_coef > 0)
    loss_t = pg_t + kl_coef * kl_t

Normalisation: a token mean over the mask of the *whole global batch*,
    loss = sum_t m_t * loss_t / sum_t m_t,
so every trained token weighs the same however the tokens are split into sequences,
micro-batches and data-parallel ranks. `ppo_clip_loss` returns the masked sum and the token
count as well as their ratio: a micro-batch hands (sum, count) to Megatron's schedule with
`calculate_per_token_loss`, which divides the summed gradient by the global count once.

A batch with no unmasked token (for example a micro-batch holding only prompt tokens) gives a
zero loss and zero gradients, not an error: under the global token mean it contributes
nothing, which is what zero says. Mismatched shapes, a non-float log-prob, or a config outside
its range are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

KlEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOClipConfig:
    """The PPO-clip policy loss's knobs."""

    eps_clip_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - eps_clip_low (0 <= eps < 1)."""
    eps_clip_high: float = 0.2
    """Upper clip range: the ratio is clipped above at 1 + eps_clip_high (DAPO uses 0.28)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the reference policy; 0 drops it (no ref log-probs)."""
    kl_estimator: KlEstimator = "k3"
    """Per-token KL(pi || ref) estimator: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 (Schulman)
    = exp(ref - logp) - (ref - logp) - 1, unbiased and never negative."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_clip_low < 1.0:
            raise ValueError(f"PPOClipConfig: eps_clip_low must be in [0, 1), got "
                             f"{self.eps_clip_low}")  # fmt: skip
        if not (self.eps_clip_high >= 0.0 and math.isfinite(self.eps_clip_high)):
            raise ValueError(f"PPOClipConfig: eps_clip_high must be finite and >= 0, got "
                             f"{self.eps_clip_high}")  # fmt: skip
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"PPOClipConfig: kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"PPOClipConfig: kl_estimator must be k1, k2 or k3, got "
                             f"{self.kl_estimator!r}")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLoss:
    """The loss of one batch of tokens and what to log about it."""

    loss: torch.Tensor
    """Token mean over the mask, loss_sum / max(num_tokens, 1); fp32 scalar, differentiable."""
    loss_sum: torch.Tensor
    """Sum of the per-token losses over the mask; fp32 scalar, differentiable."""
    num_tokens: torch.Tensor
    """Unmasked tokens (int64 scalar): the divisor of the token mean."""
    metrics: dict[str, torch.Tensor]
    """Detached fp32 token sums over the mask: pg_loss, kl, clip_frac_low, clip_frac_high,
    clip_frac, approx_kl (k3 estimate of KL(old || new)), ratio; divide by num_tokens for means."""


def _k(kind: KlEstimator, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    log_r = ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    return torch.exp(log_r) - log_r - 1.0


def _check(name: str, t: torch.Tensor, shape: torch.Size, floating: bool) -> None:
    if t.shape != shape:
        raise ValueError(
            f"ppo_clip_loss: {name} has shape {tuple(t.shape)}, but logprobs has {tuple(shape)}; "
            "every per-token input must have the log-probs' shape"
        )
    if floating and not t.is_floating_point():
        raise ValueError(f"ppo_clip_loss: {name} must be a float tensor, got {t.dtype}")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: PPOClipConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO-clip loss of `logprobs` (the policy being trained, differentiable) against the
    sampling policy's `old_logprobs`, per-token `advantages` and a 0/1 (or bool) `loss_mask`,
    all of one shape. fp32 math; gradients flow only into `logprobs`."""
    shape = logprobs.shape
    _check("logprobs", logprobs, shape, True)
    _check("old_logprobs", old_logprobs, shape, True)
    _check("advantages", advantages, shape, True)
    _check("loss_mask", loss_mask, shape, False)
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ppo_clip_loss: kl_coef = {config.kl_coef} needs ref_logprobs")
    if ref_logprobs is not None:
        _check("ref_logprobs", ref_logprobs, shape, True)

    if not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        raise ValueError("ppo_clip_loss: loss_mask must hold only 0 and 1 (or be bool)")

    on = loss_mask.detach().bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)

    def masked(x: torch.Tensor) -> torch.Tensor:
        # Masked tokens may carry anything (padding, -inf log-probs, nan advantages): select,
        # never multiply, so that no inf or nan reaches a sum or a gradient.
        return torch.where(on, x, zero)

    logp = masked(logprobs.float())
    log_ratio = logp - masked(old_logprobs.detach().float())
    adv = masked(advantages.detach().float())
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    kl = torch.zeros_like(logp)
    if ref_logprobs is not None:
        kl = _k(config.kl_estimator, logp, masked(ref_logprobs.detach().float()))
    per_token = pg + config.kl_coef * kl if config.kl_coef > 0 else pg

    def total(x: torch.Tensor) -> torch.Tensor:
        return masked(x).sum()

    n = on.sum()
    loss_sum = total(per_token)
    with torch.no_grad():
        # Where a clip bound is active the loss takes the clipped branch: no gradient there.
        low = ((ratio < 1.0 - config.eps_clip_low) & (adv < 0)).float()
        high = ((ratio > 1.0 + config.eps_clip_high) & (adv > 0)).float()
        metrics = {
            "pg_loss": total(pg),
            "kl": total(kl),
            "clip_frac_low": total(low),
            "clip_frac_high": total(high),
            "clip_frac": total(low + high),
            # k3 of the sampling policy against the new one: (r - 1) - log r, sampled from old.
            "approx_kl": total(ratio - 1.0 - log_ratio),
            "ratio": total(ratio),
        }
    return PolicyLoss(
        loss=loss_sum / n.clamp(min=1), loss_sum=loss_sum, num_tokens=n, metrics=metrics
    )
