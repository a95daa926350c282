"""Compile the exact engine's prefill (extend) variants at its start, not on the first rollout
batch that needs each one.

An engine's decode is warmed by its own CUDA-graph capture; its extend batches run eagerly and
launch the kernels of the trainer's packed prefill, whose variants follow from a batch's token
count and kind (`kernels.cuda.warmup`: one sequence, many short ones, one long among short). So
the engine generates the lengths of `warmup_batches` as prompts, one `generate` call a batch,
two new tokens each (the second is a decode step at that batch size), then empties its radix
cache. The batches reach up to the largest extend batch its scheduler forms (`PrefillLimits`).
The scheduler may cut a call into several extend batches (its token budget, its KV pool), as
it cuts a rollout's.

The warm-up leaves nothing in the radix cache (flushed at its end), and it samples under
negative sampling seeds, which no rollout uses, so the sampler's row digests (`rollout.digests`,
keyed by seed and step) never mix it with a rollout's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onpolicy.kernels.cuda.warmup import request_bounds, warmup_batches
from onpolicy.kernels.rules import cdiv

NEW_TOKENS = 2
"""Tokens each warm-up prompt generates: one from its extend batch, one from a decode step."""

TEMPERATURE = 1.0
"""The warm-up samples: greedy skips the Gumbel noise's kernel that a rollout at T > 0 runs."""

FLUSH_S = 60.0
"""Seconds SGLang may defer the final flush until its scheduler is idle (it refuses a flush
while it still retires the last batch)."""


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    """What bounds an engine's extend batches, as its scheduler resolved them."""

    max_tokens: int
    """Tokens of the largest extend batch: the chunk with chunked prefill on; else
    max_prefill_tokens, or one longer prompt alone (SGLang admits a first request above the
    budget when it does not chunk); at most the KV pool."""
    max_prompt: int
    """The longest prompt the engine takes (it refuses max_req_input_len tokens or more)."""


def prefill_limits(info: Mapping[str, Any]) -> PrefillLimits:
    """The limits from `engine.get_server_info()`: its resolved server args (the chunk size
    SGLang picked for the GPU) and its scheduler's pool and input limit."""
    pool, longest = int(info["max_total_num_tokens"]), int(info["max_req_input_len"]) - 1
    chunk = info.get("chunked_prefill_size")
    budget = chunk if chunk and chunk > 0 else max(int(info["max_prefill_tokens"]), longest)
    return PrefillLimits(max_tokens=min(int(budget), pool), max_prompt=min(longest, pool))


def _shape(config: Any, tp: int) -> tuple[int, int, int, int]:
    """(top_k, query heads per KV head, KV heads per rank, vocab) of an HF model config at TP
    `tp`; SGLang replicates KV heads over ranks when there are fewer than `tp`."""
    names = ("num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "vocab_size")
    bad = [f"{n} = {getattr(config, n, None)!r}" for n in names
           if not isinstance(getattr(config, n, None), int) or getattr(config, n) < 1]  # fmt: skip
    if bad:
        raise ValueError(f"engine warm-up: the model config needs positive integers {names} "
                         f"(a MoE config: the batches follow its top-k and heads); got "
                         f"{', '.join(bad)}")  # fmt: skip
    top_k, heads, kv, vocab = (getattr(config, n) for n in names)
    if tp < 1 or heads % tp or heads % kv or (kv % tp if kv >= tp else tp % kv):
        raise ValueError(f"engine warm-up: heads per rank: num_attention_heads = {heads} and "
                         f"num_key_value_heads = {kv} must split evenly over tp = {tp} (KV "
                         "heads may be replicated when fewer than tp)")  # fmt: skip
    kv_rank = max(kv // tp, 1)
    return top_k, heads // tp // kv_rank, kv_rank, vocab


def _fit(lengths: list[int], longest: int) -> list[int]:
    """The same tokens in prompts of at most `longest`: a longer sequence is cut into pieces
    (the engine refuses it whole, so a batch of its count holds several prompts)."""
    out = []
    for n in lengths:
        out += [longest] * ((n - 1) // longest) + [n - (n - 1) // longest * longest]
    return out


def warmup_prompts(model_config: Any, max_tokens: int, seed: int = 0, *, tp: int = 1,
                   max_prompt: int | None = None,
                   fp32: bool = False) -> list[list[list[int]]]:  # fmt: skip
    """The warm-up's generate batches, each a list of prompts (token ids): the lengths of
    `warmup_batches(max_tokens, ...)` for the config's MoE top-k and attention heads per rank at
    TP `tp` and the model's dtype (`fp32`: attention's fp32 tile), no prompt longer than
    `max_prompt` (default `max_tokens`). Ids are seeded and
    random below the vocabulary size. No prompt starts with the first token of a prompt of two
    or more tokens, so the radix cache never shortens one; a one-token prompt needs no token of
    its own, since SGLang prefills at least a prompt's last token (and the many-short batches
    hold more of them than a small vocabulary has ids)."""
    top_k, q_per_kv, kv_heads, vocab = _shape(model_config, tp)
    longest = max_tokens if max_prompt is None else max_prompt
    if max_tokens < 1 or longest < 1:
        raise ValueError(f"engine warm-up: max_tokens = {max_tokens} and max_prompt = "
                         f"{max_prompt} must be at least 1 token")  # fmt: skip
    # SGLang's LM head pads the vocabulary to a multiple of 64, then shards it over the TP ranks.
    lm_cols = cdiv(cdiv(vocab, 64) * 64, tp)
    batches = warmup_batches(max_tokens, top_k, q_per_kv, kv_heads, fp32=fp32,
                             short_bounds=request_bounds(q_per_kv, kv_heads, max_tokens,
                                                         lm_cols, fp32))  # fmt: skip
    lengths = [_fit(b, longest) for b in batches]
    multi = sum(k > 1 for b in lengths for k in b)
    if multi >= vocab:
        raise ValueError(f"engine warm-up: distinct first tokens: {multi} prompts of two or more "
                         f"tokens (max_tokens = {max_tokens}) need a first token each that no "
                         f"other prompt starts with; vocab_size is {vocab}")  # fmt: skip
    rng = random.Random(seed)
    starts = rng.sample(range(vocab), multi)
    taken = set(starts)
    singles, longer = [i for i in range(vocab) if i not in taken], iter(starts)

    def prompt(k: int) -> list[int]:
        first = next(longer) if k > 1 else rng.choice(singles)
        return [first, *(rng.randrange(vocab) for _ in range(k - 1))]

    return [[prompt(k) for k in b] for b in lengths]


def engine_prompts(engine, seed: int = 0, max_tokens: int | None = None) -> list[list[list[int]]]:
    """`warmup_prompts` for a started `sglang.Engine`: its model config, dtype, TP and limits;
    `max_tokens` caps the largest batch below the engine's own (a short warm-up)."""
    import torch

    info = engine.get_server_info()
    limits = prefill_limits(info)
    model = engine.tokenizer_manager.model_config
    hf = model.hf_text_config
    top = limits.max_tokens if max_tokens is None else min(max_tokens, limits.max_tokens)
    return warmup_prompts(hf, top, seed, tp=int(info["tp_size"]), max_prompt=limits.max_prompt,
                          fp32=model.dtype == torch.float32)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineWarmUp:
    """What an engine's warm-up ran and what it took."""

    batches: int
    """`generate` calls."""
    prompts: int
    """Prompts generated from."""
    tokens: int
    """Prompt tokens prefilled."""
    seconds: float
    """Wall time, the final flush included."""


def warm_up_engine(engine, batches: Sequence[Sequence[Sequence[int]]]) -> EngineWarmUp:
    """Generate NEW_TOKENS from every prompt of each batch, one call a batch (with log-probs and
    per-request seeds, as `rollout.engine.sample` asks), then empty the radix cache."""
    t0, done, tokens = time.perf_counter(), 0, 0
    for batch in batches:
        params = [{"temperature": TEMPERATURE, "max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                   "sampling_seed": -1 - (done + i)} for i in range(len(batch))]  # fmt: skip
        outs = engine.generate(input_ids=[list(p) for p in batch], sampling_params=params,
                               return_logprob=True)  # fmt: skip
        short = [len(o["output_ids"]) for o in outs if len(o["output_ids"]) != NEW_TOKENS]
        if len(outs) != len(batch) or short:
            raise RuntimeError(f"engine warm-up: {len(outs)} outputs for {len(batch)} prompts, "
                               f"{len(short)} of them with {sorted(set(short))} tokens, not "
                               f"{NEW_TOKENS}")  # fmt: skip
        done, tokens = done + len(batch), tokens + sum(map(len, batch))
    flushed = engine.loop.run_until_complete(
        engine.tokenizer_manager.flush_cache(timeout_s=FLUSH_S)
    )
    if not flushed.success:
        raise RuntimeError(f"engine warm-up: the engine did not empty its radix cache within "
                           f"{FLUSH_S:.0f} s: {flushed}")  # fmt: skip
    return EngineWarmUp(len(batches), done, tokens, time.perf_counter() - t0)
