"""Packing the policy update's per-token inputs (onpolicy.train.step.pack_micro_batch): each value
sits at the packed position that predicts its token, segment ends and padding are masked, the
PPO loss of the packed micro-batch equals the loss of its sequences, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
from onpolicy.train.loss import PPOClipConfig, ppo_clip_loss
from onpolicy.train.step import pack_micro_batch

SEQS = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]


def per_token(base: float) -> list[torch.Tensor]:
    return [torch.arange(len(s) - 1, dtype=torch.float32) + base + 10 * i
            for i, s in enumerate(SEQS)]  # fmt: skip


def test_values_sit_at_their_predicting_positions():
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0])]
    mb = pack_micro_batch(SEQS, per_token(-1.0), per_token(0.5), masks, multiple_of=4)
    batch = mb.inputs
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 0]  # one padding token to 8
    assert batch.targets.tolist()[:3] == [6, 7, 8] and batch.targets.tolist()[4:6] == [10, 11]
    assert mb.old_logprobs.tolist() == [-1.0, 0.0, 1.0, 0.0, 9.0, 10.0, 0.0, 0.0]
    assert mb.advantages.tolist() == [0.5, 1.5, 2.5, 0.0, 10.5, 11.5, 0.0, 0.0]
    # A segment's last position predicts nothing and the padding is no sequence: both masked.
    assert mb.loss_mask.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert mb.ref_logprobs is None


def test_packed_loss_equals_the_sequences_loss():
    g = torch.Generator().manual_seed(0)
    logp = [-torch.rand(len(s) - 1, generator=g) for s in SEQS]
    old = [lp + 0.3 * torch.randn(len(lp), generator=g) for lp in logp]
    adv = [torch.randn(len(lp), generator=g) for lp in logp]
    masks = [torch.ones(len(lp)) for lp in logp]
    mb = pack_micro_batch(SEQS, old, adv, masks, multiple_of=2)
    packed_logp = torch.zeros(len(mb.inputs.tokens))
    for (a, b), lp in zip(mb.inputs.spans, logp, strict=True):
        packed_logp[a : b - 1] = lp
    cfg = PPOClipConfig()
    packed = ppo_clip_loss(packed_logp, mb.old_logprobs, mb.advantages, mb.loss_mask, cfg)
    parts = [ppo_clip_loss(*args, cfg) for args in zip(logp, old, adv, masks, strict=True)]
    assert int(packed.num_tokens) == sum(int(p.num_tokens) for p in parts) == 5
    assert packed.loss.item() == pytest.approx(sum(p.loss_sum.item() for p in parts) / 5, rel=1e-6)


def test_a_value_count_that_does_not_match_the_sequence_is_refused():
    old = per_token(0.0)
    old[1] = old[1][:-1]
    with pytest.raises(ValueError, match="old_logprobs of a 3-token sequence must hold 2 values"):
        pack_micro_batch(SEQS, old, per_token(0.0), per_token(1.0))


def test_a_list_of_another_length_is_refused():
    with pytest.raises(ValueError, match="2 sequences but 1 advantages"):
        pack_micro_batch(SEQS, per_token(0.0), per_token(0.0)[:1], per_token(1.0))
