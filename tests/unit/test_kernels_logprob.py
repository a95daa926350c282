"""log_softmax and token log-probs: row (batch) invariance, vocab-parallel TP 1/2/4/8 equal to
the full vocab bit for bit (Qwen3's vocab 151936 included), SGLang's temperature rule, backward
vs autograd.

Each property is a harness that takes the op; the exact op must hold it, and a negative control
runs the same harness on the plain op an engine runs, which breaks it:
- rows: SGLang's default input-logprob formula `(x - max) - logsumexp(x - max)`. At a vocab
  wider than torch's intra-op grain (32768) and more than one thread, torch sums a lone row
  (a decode step) in per-thread pieces but each row of a batch on one thread. Plain
  `torch.log_softmax` (the `K.native_ops()` op, and SGLang's output-logprob path) reduces every
  row in one serial loop on CPU and holds, so it is not the control.
- vocab-parallel: Megatron's vocab-parallel log-softmax (all-reduce the max, then the sum of
  each shard's `exp(x - max).sum(-1)`), against the same formula on the unsharded row.
The controls score each row's most likely token: its log-prob is near 0, so a one-ulp change
of the log-normaliser shows in it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from adversarial import (
    DEVICES,
    DTYPES,
    PROPERTY,
    Pairs,
    assert_bitwise,
    assert_holds,
    count_broken,
    num_threads,
)
from adversarial import wide as _wide
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K

# A narrower exponent spread: logits this wide already put all mass on one token.
wide = partial(_wide, spread=4)

QWEN3_VOCAB = 151936


def tokens(m: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, vocab, (m,), generator=torch.Generator().manual_seed(seed)).to(device)


# --- rows -------------------------------------------------------------------------------------
Logprobs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(logits [m, V], tokens [m]) -> (log-prob rows [m, V], the tokens' log-probs [m])."""


def exact_logprobs(temperature: float) -> Logprobs:
    return lambda x, tok: (
        K.log_softmax(K.scale_logits(x, temperature)),
        K.token_logprobs(x, tok, temperature),
    )


def sglang_input_logprobs(x: torch.Tensor, tok: torch.Tensor):
    """SGLang's default input (prompt) log-probs on CPU: `compute_row_log_normalizer`
    (logprob_processor.py:78-95), no temperature."""
    s = x.float() - x.float().amax(-1, keepdim=True)
    rows = s - torch.logsumexp(s, -1, keepdim=True)
    return rows, rows.gather(-1, tok[:, None].long())[:, 0]


def logprob_rows(logprobs: Logprobs, x: torch.Tensor, tok: torch.Tensor) -> Pairs:
    """A batch against each row alone and against the batch reversed."""
    rows, lp = logprobs(x, tok)
    alone = [logprobs(x[i : i + 1], tok[i : i + 1]) for i in range(x.shape[0])]
    flipped_rows, flipped = logprobs(x.flip(0), tok.flip(0))
    return [
        ("log-prob rows, rows alone", rows, torch.cat([r for r, _ in alone])),
        ("token log-probs, rows alone", lp, torch.cat([t for _, t in alone])),
        ("log-prob rows, batch reversed", flipped_rows, rows.flip(0)),
        ("token log-probs, batch reversed", flipped, lp.flip(0)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=100)
@given(
    m=st.integers(1, 20),
    vocab=st.sampled_from([8, 1000, 1024, 4096, 3000, QWEN3_VOCAB]),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rows_are_independent(device, m, vocab, temperature, dtype, seed):
    x = wide(m, vocab, seed=seed, dtype=dtype, device=device)
    tok = tokens(m, vocab, seed, device)
    assert_holds(logprob_rows(exact_logprobs(temperature), x, tok))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_negative_control_sglang_input_logprobs_split_a_lone_row_over_threads(device, dtype, seed):
    """At vocab 151936 and 4 threads, torch's logsumexp sums a lone row in per-thread pieces and
    each row of a 64-row batch on one thread: 41 and 48 of the 64 most-likely-token log-probs
    differ from fp32 logits, 46 and 36 from bf16 (seeds 0, 1), and 0.22M to 0.40M of the 9.7M
    log-prob entries. On CUDA torch's reduction is laid out by the row count as well: on an
    H200, 39 and 37 of 64 from fp32, 45 and 40 from bf16. The exact op holds on the same
    logits and threads."""
    x = wide(64, QWEN3_VOCAB, seed=seed, dtype=dtype, device=device)
    tok = x.float().argmax(-1)
    with num_threads(4):
        exact = logprob_rows(exact_logprobs(1.0), x, tok)
        plain = logprob_rows(sglang_input_logprobs, x, tok)
    assert_holds(exact)
    differ, total, lines = count_broken(plain)
    assert differ > 0, f"SGLang's input log-probs held on {total} outputs: {lines}"


# --- vocab-parallel ---------------------------------------------------------------------------
VocabParallel = Callable[[list[torch.Tensor], torch.Tensor, float], torch.Tensor]
"""(logit shards [T, V/tp], tokens [T], temperature) -> the tokens' log-probs [T]."""


def megatron_vocab_parallel_logprobs(shards, tok, temperature: float = 1.0) -> torch.Tensor:
    """Megatron's vocab-parallel log-softmax (`vocab_parallel_cross_entropy`): all-reduce the
    max, each rank's `exp(x - max).sum(-1)` all-reduced in rank order, log-prob =
    (x_token - max) - log(sum)."""
    xs = [K.scale_logits(s, temperature).float() for s in shards]
    width = xs[0].shape[-1]
    vmax = torch.stack([x.amax(-1) for x in xs]).amax(0)
    total = torch.stack([torch.exp(x - vmax[:, None]).sum(-1) for x in xs]).sum(0)
    owner, local = tok // width, tok % width
    picked = torch.stack([x.gather(-1, local[:, None])[:, 0] for x in xs]).gather(0, owner[None])
    return (picked[0] - vmax) - torch.log(total)


def vocab_split(vp: VocabParallel, x, tok, tp: int, temperature: float) -> Pairs:
    """`tp` vocab shards against one shard holding the whole vocab, same formula."""
    whole = vp([x], tok, temperature)
    return [(f"tp {tp} vs tp 1", vp(list(x.chunk(tp, dim=-1)), tok, temperature), whole)]


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=100)
@given(
    vocab=st.sampled_from([1000, 1024, QWEN3_VOCAB // 16, 2048 + 8, QWEN3_VOCAB]),
    tp=st.sampled_from([1, 2, 4, 8]),
    temperature=st.sampled_from([1.0, 0.6]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_vocab_parallel_equals_full_vocab(device, vocab, tp, temperature, dtype, seed):
    assert K.vocab_parallel_exact(vocab, tp)
    x = wide(5, vocab, seed=seed, dtype=dtype, device=device)
    tok = tokens(5, vocab, seed, device)
    full = K.token_logprobs(x, tok, temperature)
    assert_holds(vocab_split(K.vocab_parallel_token_logprobs, x, tok, tp, temperature))
    assert_bitwise(K.vocab_parallel_token_logprobs([x], tok, temperature), full, "tp 1 vs full")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocab_parallel_at_qwen3_vocab(device, dtype, tp):
    """Qwen3's 151936-wide vocab, 64 tokens, each row's most likely token and a random one."""
    x = wide(64, QWEN3_VOCAB, seed=tp, dtype=dtype, device=device)
    for tok in (x.float().argmax(-1), tokens(64, QWEN3_VOCAB, tp, device)):
        for temperature in (1.0, 0.6):
            full = K.token_logprobs(x, tok, temperature)
            assert_holds(vocab_split(K.vocab_parallel_token_logprobs, x, tok, tp, temperature))
            one = K.vocab_parallel_token_logprobs([x], tok, temperature)
            assert_bitwise(one, full, "tp 1 vs full")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_negative_control_megatron_vocab_parallel_logprobs_depend_on_tp(device, dtype, tp):
    """Each rank's sum of exp(x - max) over its shard, then the sum over ranks, is another
    grouping of the vocab sum than the unsharded row's: of the 64 most-likely-token log-probs
    at vocab 151936, 43, 41 and 42 differ from fp32 logits at tp 2, 4 and 8, and 44, 46 and 46
    from bf16 (1 thread, so the unsharded sum is one serial loop); on an H200 41, 36, 38 and
    45, 40, 40. The exact op holds on the same logits."""
    x = wide(64, QWEN3_VOCAB, seed=0, dtype=dtype, device=device)
    tok = x.float().argmax(-1)
    with num_threads(1):
        exact = vocab_split(K.vocab_parallel_token_logprobs, x, tok, tp, 1.0)
        plain = vocab_split(megatron_vocab_parallel_logprobs, x, tok, tp, 1.0)
    assert_holds(exact)
    differ, total, lines = count_broken(plain)
    assert differ > 0, f"Megatron's vocab-parallel log-probs held on {total} outputs: {lines}"


@pytest.mark.parametrize("device", DEVICES)
def test_vocab_parallel_rule(device):
    assert K.vocab_segments(QWEN3_VOCAB) == 8  # Qwen3: 2^7 * 1187
    assert all(K.vocab_parallel_exact(QWEN3_VOCAB, t) for t in (1, 2, 4, 8))
    assert K.vocab_segments(1000) == 8
    assert K.vocab_segments(1002) == 2
    assert not K.vocab_parallel_exact(1002, 4)
    with pytest.raises(ValueError, match="whole segments"):
        K.vocab_parallel_token_logprobs(
            list(torch.zeros(2, 1002, device=device).chunk(3, -1)),
            torch.tensor([0, 1], device=device),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_temperature_rule_and_accuracy(device, dtype):
    """logits / T rounded to the logits' dtype (not at T = 1), then the fp32 log-softmax."""
    x = wide(6, 1000, seed=5, dtype=dtype, device=device)
    tok = torch.arange(6, device=device) * 100
    scaled = (x.float() / 0.7).to(dtype).float()
    ref = torch.log_softmax(scaled, -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(K.token_logprobs(x, tok, 0.7), ref, rtol=1e-6, atol=1e-5)
    assert_bitwise(
        K.token_logprobs(x, tok, 1.0),
        K.log_softmax(x).gather(-1, tok[:, None])[:, 0],
        "token_logprobs at T = 1 vs log_softmax",
    )
    assert_bitwise(
        K.token_logprobs(x, tok, 0.7),
        K.log_softmax(K.scale_logits(x, 0.7)).gather(-1, tok[:, None])[:, 0],
        "token_logprobs at T = 0.7 vs log_softmax of the rounded scaled logits",
    )
    assert K.token_logprobs(x, tok).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        K.token_logprobs(x, tok, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_autograd(device):
    x = wide(4, 1000, seed=6, device=device).requires_grad_()
    tok = torch.tensor([1, 500, 999, 0], device=device)
    K.token_logprobs(x, tok, 0.8).sum().backward()
    xr = x.detach().clone().requires_grad_()
    torch.log_softmax(xr / 0.8, -1).gather(-1, tok[:, None]).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
