"""PPO-clip policy loss: a hand-computed case, clipping on both sides, gradient direction, the
KL term, the global token mean over split batches, all-masked batches and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from onpolicy.train.loss import PPOClipConfig, ppo_clip_loss

CFG = PPOClipConfig(eps_clip_low=0.2, eps_clip_high=0.2)


def hand_case():
    """Five tokens; the last is masked and holds values that would poison an unmasked sum."""
    logp = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.5), -math.inf])
    logp.requires_grad_(True)
    old = torch.zeros(5)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, math.nan])
    mask = torch.tensor([1, 1, 1, 1, 0])
    return logp, old, adv, mask


def test_hand_computed_case():
    logp, old, adv, mask = hand_case()
    out = ppo_clip_loss(logp, old, adv, mask, CFG)
    # t0: r 1.5, A +1 -> max(-1.5, -1.2) = -1.2, clipped above (no gradient)
    # t1: r 0.5, A -1 -> max(0.5, 0.8) = 0.8, clipped below (no gradient)
    # t2: r 1.1, A +2 -> inside the range, -2.2, d/dlogp = -A r = -2.2
    # t3: r 0.5, A +1 -> max(-0.5, -0.8) = -0.5: the pessimistic unclipped term, d = -0.5
    assert out.loss_sum.item() == pytest.approx(-1.2 + 0.8 - 2.2 - 0.5, rel=1e-6)
    assert int(out.num_tokens) == 4
    assert out.loss.item() == pytest.approx(-3.1 / 4, rel=1e-6)
    out.loss.backward()
    expected = torch.tensor([0.0, 0.0, -2.2 / 4, -0.5 / 4, 0.0])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=0)
    m = out.metrics
    assert (m["clip_frac_low"].item(), m["clip_frac_high"].item(), m["clip_frac"].item()) == (
        1.0, 1.0, 2.0
    )  # fmt: skip
    assert m["ratio"].item() == pytest.approx(1.5 + 0.5 + 1.1 + 0.5, rel=1e-6)
    approx_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.5))
    assert m["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-5)
    assert all(math.isfinite(v.item()) for v in m.values())


@pytest.mark.parametrize("adv, grad_sign", [(1.0, -1), (-1.0, 1)])
def test_gradient_direction(adv, grad_sign):
    """Descent raises the log-prob of a token with a positive advantage, lowers a negative one."""
    logp = torch.full((3,), -1.0, requires_grad=True)
    ppo_clip_loss(logp, logp.detach(), torch.full((3,), adv), torch.ones(3), CFG).loss.backward()
    assert (torch.sign(logp.grad) == grad_sign).all(), logp.grad


@pytest.mark.parametrize(
    "ratio, adv, clipped",
    [(1.5, 1.0, True), (1.5, -1.0, False), (0.5, -1.0, True), (0.5, 1.0, False),
     (1.19, 1.0, False), (0.81, -1.0, False)],
)  # fmt: skip
def test_clipping_both_sides(ratio, adv, clipped):
    """Outside [1 - eps_low, 1 + eps_high] on the side the advantage pushes towards, the loss is
    the clipped constant (zero gradient); on the other side the unclipped term stays."""
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(1), torch.tensor([adv]), torch.ones(1), CFG)
    out.loss.backward()
    assert (logp.grad.item() == 0.0) == clipped, (ratio, adv, logp.grad)
    assert out.metrics["clip_frac"].item() == float(clipped)
    bound = 1.2 if ratio > 1 else 0.8
    assert out.loss.item() == pytest.approx(-adv * (bound if clipped else ratio), rel=1e-6)


def test_asymmetric_clip_range():
    cfg = PPOClipConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    logp = torch.tensor([math.log(1.25), math.log(1.3)], requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2), cfg)
    out.loss_sum.backward()
    assert logp.grad[0].item() == pytest.approx(-1.25, rel=1e-6) and logp.grad[1].item() == 0.0


def test_kl_term_k3():
    """k3(logp = 0, ref = log 2) = 2 - log 2 - 1; its gradient 1 - exp(ref - logp) pulls logp
    towards the reference."""
    cfg = PPOClipConfig(kl_coef=0.1)
    logp = torch.zeros(1, requires_grad=True)
    ref = torch.tensor([math.log(2.0)])
    out = ppo_clip_loss(logp, torch.zeros(1), torch.zeros(1), torch.ones(1), cfg, ref)
    assert out.metrics["kl"].item() == pytest.approx(1.0 - math.log(2.0), rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * (1.0 - math.log(2.0)), rel=1e-6)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(0.1 * (1.0 - 2.0), rel=1e-6)
    # Logged but not in the loss when the coefficient is 0.
    off = ppo_clip_loss(logp, torch.zeros(1), torch.zeros(1), torch.ones(1), CFG, ref)
    assert off.loss.item() == 0.0 and off.metrics["kl"].item() > 0


def test_token_mean_over_split_batches():
    """sum(loss_sum) / sum(num_tokens) over any split equals the loss of the whole batch."""
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(40, generator=g) * 3, -torch.rand(40, generator=g) * 3
    adv, mask = torch.randn(40, generator=g), torch.rand(40, generator=g) > 0.3
    whole = ppo_clip_loss(logp, old, adv, mask, CFG)
    parts = [ppo_clip_loss(logp[s], old[s], adv[s], mask[s], CFG)
             for s in (slice(0, 7), slice(7, 30), slice(30, 40))]  # fmt: skip
    summed = sum(p.loss_sum for p in parts) / sum(p.num_tokens for p in parts)
    assert summed.item() == pytest.approx(whole.loss.item(), rel=1e-6)
    # The mean of per-part means is a different (sequence- or micro-batch-weighted) number.
    assert sum(p.loss for p in parts).item() / 3 != pytest.approx(whole.loss.item(), rel=1e-3)


def test_all_masked_is_zero_with_zero_gradient():
    logp = torch.tensor([-math.inf, -2.0], requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(2), torch.tensor([math.nan, 3.0]), torch.zeros(2), CFG)
    assert int(out.num_tokens) == 0 and out.loss.item() == 0.0 and out.loss_sum.item() == 0.0
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2))
    assert all(v.item() == 0.0 for v in out.metrics.values())


def test_bf16_logprobs_give_fp32_loss():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    out = ppo_clip_loss(logp, logp.detach(), torch.ones(2), torch.ones(2), CFG)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and logp.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "field, bad, rule",
    [("old_logprobs", torch.zeros(4), "old_logprobs has shape \\(4,\\), but logprobs has \\(3,\\)"),
     ("advantages", torch.zeros(3, 1), "advantages has shape \\(3, 1\\)"),
     ("loss_mask", torch.ones(2), "loss_mask has shape \\(2,\\)"),
     ("loss_mask", torch.tensor([0.0, 0.5, 1.0]), "loss_mask must hold only 0 and 1"),
     ("advantages", torch.ones(3, dtype=torch.long), "advantages must be a float tensor")],
)  # fmt: skip
def test_bad_input_is_refused(field, bad, rule):
    args = {"logprobs": torch.zeros(3), "old_logprobs": torch.zeros(3),
            "advantages": torch.zeros(3), "loss_mask": torch.ones(3)}  # fmt: skip
    args[field] = bad
    with pytest.raises(ValueError, match=rule):
        ppo_clip_loss(**args, config=CFG)


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="kl_coef = 0.1 needs ref_logprobs"):
        ppo_clip_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2),
                      PPOClipConfig(kl_coef=0.1))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, rule",
    [({"eps_clip_low": 1.0}, "eps_clip_low must be in \\[0, 1\\), got 1.0"),
     ({"eps_clip_high": -0.1}, "eps_clip_high must be finite and >= 0, got -0.1"),
     ({"kl_coef": -1.0}, "kl_coef must be finite and >= 0"),
     ({"kl_estimator": "k4"}, "kl_estimator must be k1, k2 or k3, got 'k4'")],
)  # fmt: skip
def test_bad_config_is_refused(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        PPOClipConfig(**kwargs)
