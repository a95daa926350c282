"""The engine's compile warm-up (`onpolicy.rollout.warmup`) without an engine: its prompts meet
every bound of `token_bounds` from both sides, in the batch kinds the trainer's warm-up uses,
within the engine's limits (as its server info reports them), seeded, with distinct first
tokens. A real CPU engine runs `warm_up_engine` in tests/engines/test_sglang_requests.py, and
`tests/gpu/test_engine_warmup.py` checks on a GPU that a warmed engine then compiles nothing."""

from __future__ import annotations

import random
import types

import pytest
from onpolicy.kernels.cuda import attention as A
from onpolicy.kernels.cuda import linear as L
from onpolicy.kernels.cuda import moe as M
from onpolicy.kernels.cuda.warmup import request_bounds, token_bounds, warmup_batches
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
    ones, longs = request_bounds(8, 4, max_tokens, 151936)
    for b in ones:
        for t in (b, b + 1):
            assert [1] * t in got, f"no batch of {t} one-token prompts (bound {b})"
    for b in longs:
        for t in (b, b + 1):
            assert t <= 513 or [513] + [1] * (t - 513) in got, f"no long among {t - 513} short"


def test_request_bounds_at_qwen3_heads():
    """Derived by hand for 8 query heads a KV head, 4 KV heads, 16-row decode tiles: R one-token
    requests take DECODE_FEW up to 32, split while 4 (R // 2 + R) < 528, i.e. R <= 87, and the
    LM head's tile changes past 16, 64 and 512 rows (151936 columns fill LARGE_M's waves at any
    M > 512); a long request (513 tokens) among t - 513 short ones runs the 128-row tile while
    8t > 16 (t - 512), i.e. t <= 1023, split while 4 (8t // 128 + t - 512) < 528, t <= 606."""
    assert request_bounds(8, 4, 4096, 151936) == ([16, 32, 64, 87, 512], [513, 606, 1023])
    # A narrow LM head fills LARGE_M's waves only at 16769 rows (131 x 4 tiles of 256 columns).
    assert request_bounds(8, 4, 20000, 1024)[0] == [16, 32, 64, 87, 512, 16768]


def variants(lengths: list[int], vocab: int = 151936) -> set:
    """The host choices an engine's forward of this batch makes (one token sampled a request):
    attention's (tile, split) on the device path, each T-row GEMM's tile, the MoE's path and
    tile, the LM head's tile over one row a request."""
    t, r, g, kv = sum(lengths), len(lengths), 8, 4
    tile = A.tile_for(t * g, r)
    split = A.split_for(t * g // tile[0] + r, kv, 2 * A.KV_PARTITION)
    pairs = 8 * t
    moe = ("pairs",) if pairs <= M.SMALL_PAIRS else L.tile_for(pairs, 768, 1, tma=False)
    return {
        ("attention", tile, split),
        ("lm_head", L.tile_for(r, vocab)),
        ("moe", moe),
        *(("gemm", n, L.tile_for(t, n)) for n in (5120, 2048, 128)),
    }


def test_the_warm_up_launches_every_variant_of_random_batches():
    """Random batches of at most 4096 tokens (one-token and short prompts, a long one among
    them, one prompt alone) launch no host choice the warm-up batches did not. Control: without
    its short batches the warm-up misses some."""

    def cover(batches):
        return set().union(*(variants(b) for b in batches))

    warm = cover(lengths(warmup_prompts(CONFIG, 4096, seed=0)))
    rng = random.Random(0)
    batches = [[1] * rng.randint(1, 4096) for _ in range(100)]
    batches += [[rng.randint(1, 40) for _ in range(rng.randint(1, 100))] for _ in range(100)]
    batches += [[rng.randint(513, 3000), *[1] * rng.randint(0, 1000)] for _ in range(100)]
    batches += [[rng.randint(1, 4096)] for _ in range(100)]
    batches = [b for b in batches if sum(b) <= 4096]
    missed = [b[:3] for b in batches if not variants(b) <= warm]
    assert not missed, f"{len(missed)} batches launch variants the warm-up did not: {missed[:5]}"
    bare = cover(warmup_batches(4096, 8, 8, 4, short_bounds=([], [])))
    assert any(not variants(b) <= bare for b in batches)


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
    whole = warmup_batches(4096, 8, 8, 4, short_bounds=request_bounds(8, 4, 4096, 151936))
    assert max(max(b) for b in whole) > 1000
    cut = lengths(warmup_prompts(CONFIG, 4096, max_prompt=1000))
    assert max(max(b) for b in cut) <= 1000
    assert [sum(b) for b in cut] == [sum(b) for b in whole]
    assert [4096] not in cut and [1000, 1000, 1000, 1000, 96] in cut


def test_first_tokens_are_distinct_and_ids_are_within_the_vocabulary():
    """No prompt starts with the first token of a prompt of two or more tokens (the radix cache
    could shorten it); one-token prompts, which it cannot, outnumber a small vocabulary: here 17
    ids, 16 of them first tokens of longer prompts, the 17th that of every one-token prompt."""
    vocab = 17
    cfg = types.SimpleNamespace(**{**vars(CONFIG), "vocab_size": vocab})
    prompts = [p for b in warmup_prompts(cfg, 1200, seed=3) for p in b]
    multi = [p[0] for p in prompts if len(p) > 1]
    singles = {p[0] for p in prompts if len(p) == 1}
    assert len(prompts) == 2653 > vocab and len(multi) == 16
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
      "vocab_size": 10})}, "distinct first tokens: 12 prompts of two or more tokens"),
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
