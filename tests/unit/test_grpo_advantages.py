"""Group advantages: hand-computed groups, equal-reward groups exactly zero, the Dr. GRPO form,
the sample std, order and determinism, and refused input."""

from __future__ import annotations

import math
import random
import struct

import pytest
from onpolicy.grpo.advantages import group_advantages


def bits(xs: list[float]) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


def test_hand_computed_group_of_two():
    # mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    adv = group_advantages([1.0, 0.0], 2, eps=0.0)
    s = math.sqrt(0.5)
    assert adv == [0.5 / s, -0.5 / s]


def test_hand_computed_group_of_four_with_eps():
    # rewards 0, 0, 0, 1: mean 0.25; centred -0.25 x3, 0.75; sum sq = 3/16 + 9/16 = 0.75;
    # sample variance 0.75 / 3 = 0.25 -> std 0.5
    adv = group_advantages([0.0, 0.0, 0.0, 1.0], 4, eps=1e-6)
    d = 0.5 + 1e-6
    assert adv == [-0.25 / d, -0.25 / d, -0.25 / d, 0.75 / d]
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_sample_std_not_population_std():
    # population std of [0, 1] is 0.5, sample std is sqrt(0.5): the result says which was used
    adv = group_advantages([0.0, 1.0], 2, eps=0.0)
    assert adv[1] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-15)
    assert adv[1] != pytest.approx(1.0)


def test_groups_are_independent_and_in_order():
    rewards = [0.0, 1.0, 5.0, 5.0, 2.0, 4.0]
    adv = group_advantages(rewards, 2, eps=0.0)
    s = math.sqrt(0.5)
    assert adv[0:2] == [-0.5 / s, 0.5 / s]
    assert adv[2:4] == [0.0, 0.0]
    assert adv[4:6] == [-1.0 / (2 * s), 1.0 / (2 * s)]


def test_equal_rewards_give_exact_zeros():
    # fsum([0.1] * 3) / 3 is 0.10000000000000002, so r - mean alone would not be zero
    assert math.fsum([0.1] * 3) / 3 != 0.1
    adv = group_advantages([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], 3)
    assert bits(adv) == bits([0.0] * 6)
    assert group_advantages([0.3] * 4, 4, normalize_std=False) == [0.0] * 4


def test_group_of_one_is_zero():
    assert group_advantages([0.2, 0.9, 0.0], 1) == [0.0, 0.0, 0.0]


def test_without_std_normalisation():
    adv = group_advantages([0.0, 0.5, 1.0], 3, normalize_std=False)
    assert adv == [-0.5, 0.0, 0.5]


def test_empty_input():
    assert group_advantages([], 4) == []


def test_deterministic_and_order_independent_mean():
    rng = random.Random(0)
    rewards = [rng.random() for _ in range(64)]
    a = group_advantages(rewards, 8)
    b = group_advantages(list(rewards), 8)
    assert bits(a) == bits(b)
    # a permutation inside a group permutes the advantages bit for bit (fsum is exact)
    perm = rewards[:8][::-1] + rewards[8:]
    c = group_advantages(perm, 8)
    assert bits(c[:8]) == bits(a[:8][::-1])
    assert all(sum(a[g : g + 8]) == pytest.approx(0.0, abs=1e-12) for g in range(0, 64, 8))


def test_refusals_name_the_values():
    with pytest.raises(ValueError, match=r"5 rewards .* groups of 2"):
        group_advantages([0.0] * 5, 2)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        group_advantages([0.0] * 4, 0)
    with pytest.raises(ValueError, match="got -2"):
        group_advantages([0.0] * 4, -2)
    with pytest.raises(ValueError, match="rewards must be finite.*nan"):
        group_advantages([0.0, math.nan], 2)
    with pytest.raises(ValueError, match="eps must be finite and >= 0, got -1"):
        group_advantages([0.0, 1.0], 2, eps=-1.0)
