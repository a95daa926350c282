"""The process's K segments (`onpolicy.segments`): ONPOLICY_K_SEGMENTS parsed once, each rank's
share of S, the default of a process alone (its own TP), and the reference model built at S."""

from __future__ import annotations

import os

import pytest
import torch
from onpolicy import segments
from onpolicy.bits import assert_bitwise, n_differ
from onpolicy.models.reference import Qwen3MoeReference
from onpolicy.models.tiny import tiny
from onpolicy.segments import ENV, KSegments


@pytest.fixture
def configured(monkeypatch):
    """`configured(text)`: this process started with ONPOLICY_K_SEGMENTS = text (None: unset)."""

    def set_(text: str | None) -> None:
        if text is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, text)
        segments.current.cache_clear()

    yield set_
    segments.current.cache_clear()


def test_a_process_alone_takes_its_own_tp(configured):
    configured(None)
    assert segments.current() is None
    assert [segments.per_rank("attention", tp) for tp in (1, 2, 4)] == [1, 1, 1]
    assert Qwen3MoeReference(tiny(), torch.float32).segments == KSegments()


def test_each_rank_takes_its_share_of_the_runs_s(configured):
    configured("attention=4,experts=2")
    assert segments.current() == KSegments(attention=4, experts=2)
    assert [segments.per_rank("attention", tp) for tp in (1, 2, 4)] == [4, 2, 1]
    assert [segments.per_rank("experts", tp) for tp in (1, 2)] == [2, 1]
    with pytest.raises(ValueError, match=r"experts K is cut into S = 2 segments, which 4 ranks"):
        segments.per_rank("experts", 4)
    # The reference is unsplit: the whole S, unless given another.
    assert Qwen3MoeReference(tiny(), torch.float32).segments == KSegments(attention=4, experts=2)
    mine = KSegments(attention=1, experts=1)
    assert Qwen3MoeReference(tiny(), torch.float32, segments=mine).segments == mine


def test_the_variable_is_read_once(configured):
    configured("attention=2,experts=1")
    first = segments.current()
    os.environ[ENV] = "attention=8,experts=8"  # a change after start is not seen
    assert segments.current() is first == KSegments(attention=2, experts=1)


def test_a_malformed_variable_is_refused_naming_it(configured):
    configured("attention=2;experts=1")
    with pytest.raises(ValueError, match=r"ONPOLICY_K_SEGMENTS='attention=2;experts=1'"):
        segments.current()


def test_the_reference_computes_at_its_s():
    """The reference's o_proj and experts' down projection take S: with non-power-of-2 Ks
    (attention 3 x 16 = 48, experts 48) S = 2 and S = 1 are other trees, so the log-probs
    differ (the control that S reaches the kernels); with power-of-2 Ks (the default tiny) the
    CPU segment tree is the block tree and S changes no bits."""
    seq = [[(7 * i + 3) % 997 for i in range(24)]]
    odd = tiny(num_attention_heads=3, num_key_value_heads=1, moe_intermediate_size=48)
    for cfg, same in ((odd, False), (tiny(), True)):
        one = Qwen3MoeReference.random(cfg, dtype=torch.float32, seed=3)
        two = Qwen3MoeReference.random(cfg, dtype=torch.float32, seed=3,
                                       segments=KSegments(attention=2, experts=2))  # fmt: skip
        a, b = one.score(seq, 1.0)[0], two.score(seq, 1.0)[0]
        if same:
            assert_bitwise(a, b, "power-of-2 K at S = 1 and 2")
        else:
            assert n_differ(a, b) > 0, "S = 2 and S = 1 gave the same bits"
