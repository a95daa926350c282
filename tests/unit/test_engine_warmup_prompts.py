"""The engine's compile warm-up (`onpolicy.rollout.warmup`) without an engine: its prompts meet
every bound of `token_bounds` from both sides, in the batch kinds the trainer's warm-up uses,
within the engine's limits (as its server info reports them), seeded, with distinct first
tokens. A real CPU engine runs `warm_up_engine` in tests/engines/test_sglang_requests.py, and
`tests/gpu/test_engine_warmup.py` checks on a GPU that a warmed engine then compiles nothing."""

from __future__ import annotations

import types

import pytest
from onpolicy.kernels.cuda.warmup import token_bounds, warmup_batches
from onpolicy.rollout.warmup import (
    PrefillLimits,
    prefill_limits,
    warmup_prompts,
)

CONFIG = types.SimpleNamespace(num_experts_per_tok=8, num_attention_heads=32,
                               num_key_value_heads=4, vocab_size=151936)  # fmt: skip
"""Qwen3-30B-A3B's routing and heads (configs/one-gpu.toml)."""


def lengths(batches: list[list[list[int]]]) -> list[list[int]]:
    return [[len(p) for p in b] for b in batches]


@pytest.mark.parametrize("max_tokens", [1200, 4096])
def test_the_prompts_meet_every_bound_from_both_sides(max_tokens):
    got = lengths(warmup_prompts(CONFIG, max_tokens, seed=0))
    bounds = token_bounds(8, 8, 4, max_tokens)
    assert {8, 16, 64, 512} <= set(bounds) and (2096 in bounds) == (max_tokens > 2096), bounds
    for b in bounds:
        for t in (b, b + 1):
            assert [t] in got, f"no batch of one prompt of {t} tokens (bound {b})"
            assert [1] * t in got, f"no batch of {t} one-token prompts (bound {b})"


def test_the_heads_per_rank_follow_tp():
    """At TP 2 a rank holds 2 KV heads: attention's split ends at 4208 tokens, not 2096."""
    one, two = (lengths(warmup_prompts(CONFIG, 5000, tp=tp)) for tp in (1, 2))
    assert 4208 in token_bounds(8, 8, 2, 5000) and 2096 not in token_bounds(8, 8, 2, 5000)
    assert [2097] in one and [4209] not in one
    assert [4208] in two and [4209] in two and [2097] not in two


def test_no_prompt_exceeds_the_engine_limits():
    for b in lengths(warmup_prompts(CONFIG, 4096)):
        assert sum(b) <= 4096, b
    # A prompt longer than the engine takes is cut; the batch keeps its tokens.
    whole = warmup_batches(4096, 8, 8, 4)
    assert max(max(b) for b in whole) > 1000
    cut = lengths(warmup_prompts(CONFIG, 4096, max_prompt=1000))
    assert max(max(b) for b in cut) <= 1000
    assert [sum(b) for b in cut] == [sum(b) for b in whole]
    assert [4096] not in cut and [1000, 1000, 1000, 1000, 96] in cut


def test_first_tokens_are_distinct_and_ids_are_within_the_vocabulary():
    """No prompt starts with the first token of a prompt of two or more tokens (the radix cache
    could shorten it); one-token prompts, which it cannot, outnumber a small vocabulary: here 11
    ids, 10 of them first tokens of longer prompts, the 11th that of every one-token prompt."""
    vocab = 11
    cfg = types.SimpleNamespace(**{**vars(CONFIG), "vocab_size": vocab})
    prompts = [p for b in warmup_prompts(cfg, 1200, seed=3) for p in b]
    multi = [p[0] for p in prompts if len(p) > 1]
    singles = {p[0] for p in prompts if len(p) == 1}
    assert len(prompts) == 3102 > vocab and len(multi) == 10
    assert len(set(multi)) == len(multi) and len(singles) == 1 and not singles & set(multi)
    ids = [t for p in prompts for t in p]
    assert min(ids) >= 0 and max(ids) < vocab


def test_the_prompts_are_seeded():
    a, b, c = (warmup_prompts(CONFIG, 600, seed=s) for s in (1, 1, 2))
    assert a == b and a != c
    assert lengths(a) == lengths(c)


@pytest.mark.parametrize(("kw", "says"), [
    ({"max_tokens": 0}, "max_tokens = 0"),
    ({"max_tokens": 600, "max_prompt": 0}, "max_prompt = 0"),
    ({"max_tokens": 600, "tp": 3}, "split evenly over tp = 3"),
    ({"max_tokens": 600, "config": types.SimpleNamespace(num_attention_heads=32,
      num_key_value_heads=4, vocab_size=151936)}, "num_experts_per_tok = None"),
    ({"max_tokens": 600, "config": types.SimpleNamespace(**{**vars(CONFIG),
      "vocab_size": 10})}, "distinct first tokens: 10 prompts of two or more tokens"),
])  # fmt: skip
def test_bad_input_is_refused_naming_the_rule(kw, says):
    cfg = kw.pop("config", CONFIG)
    with pytest.raises(ValueError, match=says):
        warmup_prompts(cfg, **kw)


INFO = {"chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
        "max_total_num_tokens": 600, "max_req_input_len": 400, "tp_size": 1}  # fmt: skip
"""The part of `sglang.Engine.get_server_info()` the warm-up reads."""


@pytest.mark.parametrize(("info", "want"), [
    (INFO, PrefillLimits(600, 399)),  # the pool bounds the chunk
    ({**INFO, "chunked_prefill_size": 256}, PrefillLimits(256, 399)),
    ({**INFO, "chunked_prefill_size": -1, "max_prefill_tokens": 100}, PrefillLimits(399, 399)),
    ({**INFO, "chunked_prefill_size": None, "max_total_num_tokens": 10**5,
      "max_req_input_len": 40955}, PrefillLimits(40954, 40954)),
    ({**INFO, "chunked_prefill_size": None, "max_total_num_tokens": 10**5}, PrefillLimits(16384,
                                                                                        399)),
])  # fmt: skip
def test_prefill_limits_follow_the_scheduler(info, want):
    assert prefill_limits(info) == want
