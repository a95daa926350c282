"""The engine's compile warm-up (`onpolicy.rollout.warmup`) without an engine: its prompts meet
every bound of `token_bounds` from both sides, in the batch kinds the trainer's warm-up uses,
within the engine's limits, seeded, with distinct first tokens; `warm_up_engine` asks an engine
what `launch` needs; `launch` warms up an exact CUDA engine by default and nothing else.
`tests/gpu/test_engine_warmup.py` checks on a GPU that a real engine then compiles nothing."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest
from onpolicy.kernels.cuda.warmup import token_bounds, warmup_batches
from onpolicy.rollout import engine as E
from onpolicy.rollout.warmup import (
    NEW_TOKENS,
    PrefillLimits,
    prefill_limits,
    warm_up_engine,
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


class FakeEngine:
    """What the warm-up asks of an `sglang.Engine`, recorded."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.info, self.calls, self.flushes = kwargs, dict(INFO), [], []
        self.new_tokens, self.flush_ok, self.shut = NEW_TOKENS, True, False
        self.loop = asyncio.new_event_loop()
        config = types.SimpleNamespace(hf_text_config=CONFIG)
        self.tokenizer_manager = types.SimpleNamespace(model_config=config, flush_cache=self.flush)

    def get_server_info(self) -> dict:
        return dict(self.info)

    def generate(self, *, input_ids, sampling_params, return_logprob=False) -> list[dict]:
        self.calls.append((input_ids, sampling_params, return_logprob))
        return [{"output_ids": [7] * self.new_tokens} for _ in input_ids]

    async def flush(self, timeout_s=None):
        self.flushes.append((len(self.calls), timeout_s))
        return types.SimpleNamespace(success=self.flush_ok)

    def shutdown(self) -> None:
        self.shut = True
        self.loop.close()


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.loop.close()


def test_warm_up_engine_generates_each_batch_then_empties_the_cache(engine):
    batches = [[[5]], [[6, 1, 2], [9, 4]], [[3] * 7]]
    w = warm_up_engine(engine, batches)
    assert [c[0] for c in engine.calls] == batches
    assert all(c[2] for c in engine.calls), "log-probs, as a rollout asks"
    params = [p for c in engine.calls for p in c[1]]
    assert {(p["max_new_tokens"], p["temperature"], p["ignore_eos"]) for p in params} == {
        (2, 1.0, True)}  # fmt: skip
    seeds = [p["sampling_seed"] for p in params]
    assert len(set(seeds)) == 4 and max(seeds) < 0, seeds  # no rollout's seed
    assert engine.flushes == [(3, 60.0)], "one flush, after the last batch"
    assert (w.batches, w.prompts, w.tokens) == (3, 4, 13) and w.seconds >= 0


def test_warm_up_engine_refuses_short_outputs_and_a_failed_flush(engine):
    engine.new_tokens = 1
    with pytest.raises(RuntimeError, match=r"2 outputs for 2 prompts, 2 of them with \[1\]"):
        warm_up_engine(engine, [[[1], [2]]])
    engine.new_tokens, engine.flush_ok = NEW_TOKENS, False
    with pytest.raises(RuntimeError, match="did not empty its radix cache"):
        warm_up_engine(engine, [[[1], [2]]])


@pytest.mark.parametrize(("exact", "device", "warm_up", "warmed"), [
    (True, "cuda", None, True), (False, "cuda", None, False), (True, "cpu", None, False),
    (True, "cuda", False, False), (True, "cpu", True, True),
])  # fmt: skip
def test_launch_warms_up_an_exact_cuda_engine_by_default(monkeypatch, exact, device, warm_up,
                                                         warmed):  # fmt: skip
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    engine = E.launch("/ckpt", exact=exact, device=device, warm_up=warm_up)
    try:
        assert engine.kwargs["device"] == device and not engine.shut
        assert bool(engine.calls) == warmed and bool(engine.flushes) == warmed
        if warmed:  # the batches of the engine's own limits and model
            want = lengths(warmup_prompts(CONFIG, 600, max_prompt=399))
            assert [[len(p) for p in c[0]] for c in engine.calls] == want
    finally:
        engine.loop.close()


def test_launch_shuts_the_engine_down_when_its_warm_up_fails(monkeypatch):
    made = []

    class Failing(FakeEngine):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.flush_ok = False
            made.append(self)

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Failing))
    with pytest.raises(RuntimeError, match="did not empty its radix cache"):
        E.launch("/ckpt", device="cuda")
    assert made[0].shut
