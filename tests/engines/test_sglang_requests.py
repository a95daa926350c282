"""Requests outside the exact sampling rule are refused at validation; the engine keeps serving.

One exact TP1 bf16 Engine (workers/sglang_requests.py) gets requests with top_p, top_k and
min_p set, each alone: each must come back with an error naming the setting and the rule, and
a valid seeded request sent after them must still be answered, its log-probs bitwise equal to
the reference model's score (the engine survived and is still exact). That engine starts while
a neighbour process takes all the host's available memory but 3 GiB: a CPU engine's KV pool is
sized in tokens, not from the free memory SGLang measures around the weights' load. The negative
control sends the same bad requests to the stock engine (no switch), which accepts them: the
refusal comes from the onpolicy hook, not from SGLang's own checks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from neighbour import GiB, neighbour_taking_memory
from onpolicy.bits import mismatch_report, n_differ

WORKER = Path(__file__).parent / "workers" / "sglang_requests.py"
REPO = Path(__file__).resolve().parents[2]
NEW = 8
"""Tokens sampled per request."""
LEAVE_GIB = 3.0
"""Available memory the neighbour leaves while the exact engine starts."""
WARM_UP_TOKENS = 40
"""The largest batch of the exact engine's warm-up, run after the requests (a launch's would reach
its chunk)."""
VOCAB = 1000
"""A vocabulary size for the unit checks (larger than every top_k below)."""


def _params(**extra) -> dict:
    return {"temperature": 1.0, "max_new_tokens": NEW, "sampling_seed": 7, "ignore_eos": True,
            **extra}  # fmt: skip


BAD = {"top_p": 0.9, "top_k": 5, "min_p": 0.1}
"""One setting each, off the rule (top_p 1, top_k -1, min_p 0)."""
GOOD_PROMPT = [3, 14, 15, 92, 65, 35]
REQUESTS = [
    *({"prompt": [1, 2, 3, 4], "params": _params(**{k: v})} for k, v in BAD.items()),
    {"prompt": GOOD_PROMPT, "params": _params()},
]
"""The bad requests, then a valid one (sent after them, to the same engine)."""


def _env(cache: Path) -> dict[str, str]:
    from onpolicy.rollout import engine_env

    overlay = [str(REPO / "build" / "upstream" / "sglang")] if _overlay() else []
    path = [*overlay, str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **engine_env(1, cache), "PYTHONPATH": os.pathsep.join(path)}


def _overlay() -> bool:
    """Use the patched git tree when the caller put it on PYTHONPATH (patch development)."""
    return "build/upstream/sglang" in os.environ.get("PYTHONPATH", "")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory, compile_cache):
    """stock? -> the worker's result for REQUESTS; each engine runs once, when first asked for."""

    @functools.cache
    def get(stock: bool) -> dict:
        tmp = tmp_path_factory.mktemp("sglang-requests-stock" if stock else "sglang-requests")
        plan = {"ckpt": str(tiny_checkpoint), "requests": REQUESTS, "stock": stock,
                "warm_up_tokens": 0 if stock else WARM_UP_TOKENS}  # fmt: skip
        (tmp / "plan.json").write_text(json.dumps(plan))
        out = tmp / "result.json"
        cmd = [sys.executable, str(WORKER), "--plan", str(tmp / "plan.json"), "--out", str(out)]
        # The exact engine starts while a neighbour holds all free memory but a few GiB: a
        # CPU engine's KV pool is sized in tokens, so its start does not depend on it. (At
        # SGLang's mem_fraction_static 0.05 this start fails: "Loaded weights leave no GPU
        # memory".) The worker starts once the neighbour holds it all.
        take = neighbour_taking_memory(LEAVE_GIB) if not stock else contextlib.nullcontext()
        with take as neighbour:
            if neighbour is not None:  # it holds what it took, resident, as the worker starts
                pid, hold = neighbour
                held = psutil.Process(pid).memory_info().rss
                assert hold > 4 * GiB and held > 0.95 * hold, (hold / GiB, held / GiB)
            p = subprocess.run(
                cmd, env=_env(compile_cache), capture_output=True, text=True, timeout=900
            )
        if not stock:
            print(f"[exact] started while a neighbour held {held / GiB:.1f} GiB")
        if p.returncode != 0:
            pytest.fail(f"SGLang requests worker exited {p.returncode}\n{p.stderr[-8000:]}")
        res = json.loads(out.read_text())
        print(f"[{'stock' if stock else 'exact'}] engine start {res['start_seconds']:.1f} s, "
              f"total {res['seconds']:.1f} s ({res['sglang']})")  # fmt: skip
        return res

    return get


@pytest.mark.slow
def test_bad_requests_are_refused_and_the_engine_stays_exact(engine, tiny_checkpoint):
    from onpolicy.models.reference import Qwen3MoeReference

    answers = engine(False)["answers"]
    for (name, value), ans in zip(BAD.items(), answers, strict=False):
        err = ans.get("error", "")
        print(f"[exact] {name}={value}: {err}")
        assert f"onpolicy sampling: {name} = {value}" in err, ans
        assert "full distribution (top_p 1, top_k -1, min_p 0)" in err, err
    good = answers[len(BAD)]
    assert "error" not in good, good
    assert len(good["output_ids"]) == NEW and good["logprob_tokens"] == good["output_ids"]
    model = Qwen3MoeReference.from_pretrained(tiny_checkpoint, torch.bfloat16)
    want = model.score([GOOD_PROMPT + good["output_ids"]], 1.0)[0][len(GOOD_PROMPT) - 1 :]
    got = torch.tensor(good["logprob_bits"], dtype=torch.int64).to(torch.int32).view(torch.float32)
    bad = n_differ(got, want)
    print(f"[exact] valid request after the refusals: decode == score {NEW - bad}/{NEW} tokens")
    assert bad == 0, mismatch_report(got, want)


def test_the_warm_up_runs_on_the_engine_and_leaves_it_exact(engine, tiny_checkpoint):
    """`rollout.warmup` on the real engine: every prompt of every batch answered (it raises
    otherwise), the radix cache emptied (likewise), the limits its server info reports, and the
    valid request answered after it with the bits it had before."""
    from onpolicy.kernels.cuda.warmup import token_bounds
    from onpolicy.models.reference import Qwen3MoeReference

    res = engine(False)
    warm, before = res["warm_up"], res["answers"][len(BAD)]
    print(f"[exact] warm-up: {warm['batches']} batches, {warm['prompts']} prompts, "
          f"{warm['tokens']} tokens in {warm['seconds']:.1f} s; a launch's: "
          f"{warm['launch_batches']} batches, {warm['launch_prompts']} prompts up to "
          f"{warm['max_tokens']} tokens")  # fmt: skip
    cfg = Qwen3MoeReference.from_pretrained(tiny_checkpoint, torch.bfloat16).cfg
    sent = [sum(b) for b in warm["sent"]]
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    for b in token_bounds(cfg.num_experts_per_tok, g, cfg.num_key_value_heads, WARM_UP_TOKENS):
        assert b in sent and b + 1 in sent, (b, sent)
    assert warm["prompts"] == sum(map(len, warm["sent"])) and max(sent) == WARM_UP_TOKENS
    assert warm["max_prompt"] > 0 and warm["max_tokens"] > 0 and warm["launch_prompts"] > 0, warm
    assert warm["after"] == before, "the valid request's answer changed after the warm-up"


@pytest.mark.slow
def test_stock_engine_accepts_the_same_requests(engine):
    answers = engine(True)["answers"]
    for (name, value), ans in zip(BAD.items(), answers, strict=False):
        print(f"[stock] {name}={value}: {ans.get('error') or 'answered'}")
        assert "error" not in ans and len(ans["output_ids"]) == NEW, ans


def test_check_sampling_params_names_each_setting():
    from onpolicy.rollout.sampler import FULL, RowParams, check_sampling_params

    check_sampling_params(RowParams(-1, 1.0, 0.0), VOCAB)  # the defaults
    check_sampling_params(RowParams(1 << 30, 1.0, 0.0), VOCAB)  # SGLang's parsed -1
    check_sampling_params(RowParams(VOCAB, 1.0, 0.0), VOCAB)  # the whole vocabulary
    check_sampling_params(RowParams(1, 0.9, 0.1), VOCAB)  # greedy keeps the argmax either way
    cases = {"top_p = 0.9": RowParams(-1, 0.9, 0.0), "min_p = 0.1": RowParams(-1, 1.0, 0.1),
             "top_k = 5": RowParams(5, 1.0, 0.0)}  # fmt: skip
    for what, params in cases.items():
        with pytest.raises(ValueError, match=f"onpolicy sampling: {what}; ") as e:
            check_sampling_params(params, VOCAB)
        assert FULL in str(e.value)
    flags = {"custom_logit_processor": "serialized", "return_sampling_mask": True,
             "watermark": True}  # fmt: skip
    for name, value in flags.items():
        with pytest.raises(ValueError, match=f"onpolicy sampling: {name} is "):
            check_sampling_params(RowParams(-1, 1.0, 0.0), VOCAB, **{name: value})


def test_check_sampling_params_refuses_logit_edits():
    from types import SimpleNamespace

    from onpolicy.rollout.sampler import check_sampling_params

    neutral = {"top_k": -1, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0,
               "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
               "logit_bias": None, "json_schema": None, "regex": None, "ebnf": None,
               "structural_tag": None}  # fmt: skip
    check_sampling_params(SimpleNamespace(**neutral), VOCAB)
    cases = {"frequency_penalty = 0.5": {"frequency_penalty": 0.5},
             "presence_penalty = 0.5": {"presence_penalty": 0.5},
             "repetition_penalty = 1.1": {"repetition_penalty": 1.1},
             "min_new_tokens = 4": {"min_new_tokens": 4},
             "logit_bias = ": {"logit_bias": {"3": 1.0}},
             "regex is set": {"regex": "a+"},
             "json_schema is set": {"json_schema": "{}"}}  # fmt: skip
    for what, edit in cases.items():
        for top_k in (-1, 1):  # greedy too: an edit can move the argmax
            params = SimpleNamespace(**(neutral | {"top_k": top_k} | edit))
            with pytest.raises(ValueError, match=f"onpolicy sampling: {what}") as e:
                check_sampling_params(params, VOCAB)
            assert "edits the logits" in str(e.value)
