"""The exact SGLang path on a real Engine: sampled log-probs equal the reference model's score.

Each layout (TP1, TP2, TP2 EP2) gets one worker process (workers/sglang_exact.py) that starts
real `sglang.Engine(device="cpu", rl_on_policy_target="onpolicy")` engines one after the other
on the tiny checkpoint, in bf16 (the contract dtype) and fp32, and answers the same plan of
requests on each. Every check below reads those results; bits are compared as integer views.

Launches are the cost (tens of seconds each on 2 cores), so they are shared:
- a main engine per (layout, dtype): chunked prefill off, radix cache off. Its plan holds every
  request alone, then all of them co-batched (other lengths, both temperatures);
- the chunk sweep runs at TP1: size 7 in both dtypes, size 1 (one token per forward, the
  slowest engine of the file, radix cache off) in bf16, the contract dtype; and size 7 at TP2
  bf16: the chunk boundaries move only the attention's query rows, whose arithmetic is the
  same at every TP, while TP changes only the sums the TP1 == TP2 check covers. Size 7 cuts
  every prompt longer than 7 tokens; its engines also have the radix cache on, with
  requests that share a prompt prefix or continue an earlier request's generated tokens (the
  cache then holds decode-made keys);
- the negative controls: the stock engine (torch_native attention, SGLang's own ops), TP1
  fp32, with chunking and the cache off, and with chunk 7 and the cache on, and TP2 EP2 fp32;
  the same harnesses (decode == score, alone vs co-batched, chunked/cached vs not, TP1 vs TP2)
  must find differing bits there. Decode == score holds each sampled sequence to its own score;
  the engine-vs-engine controls run the plan greedily (the stock sampler ignores the seed) and
  compare the two runs' common token prefix, where only the ops differ.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from onpolicy.bits import mismatch_report, n_differ

pytestmark = pytest.mark.timeout(2400)  # the TP1 worker's engines, run by its first test
WORKER = Path(__file__).parent / "workers" / "sglang_exact.py"
REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp2-ep2": (2, 2)}
CUDA_KV_BRANCH = Path(__file__).parent / "cuda_kv_branch"
CUDA_KV_LAYOUTS = ("tp2",)
"""Layouts whose engines take SGLang's CUDA branch of the fused-KV-write decision (its
sitecustomize): with a bf16 pool that branch leaves the KV write to a fused RoPE kernel the
exact path does not run, so every check of these engines also holds the exact path to writing
its own cache (unwritten on an H100 before the route-RoPE patch said no). Only exact engines:
the stock TP2 EP2 engine's torch RoPE refuses the fused write outright."""
DTYPES = ("bfloat16", "float32")
NEW = 10
"""Tokens sampled per request."""


def _req(prompt, temperature, seed, **extra) -> dict:
    return {"prompt": prompt, "temperature": temperature, "seed": seed, "new_tokens": NEW,
            **extra}  # fmt: skip


PREFIX = [(7 * i + 3) % 997 for i in range(30)]
"""A prompt prefix three requests share (the radix cache's hit)."""
LONG = [(13 * i + 5) % 991 for i in range(90)]
"""Longer than the largest chunk size, so every chunk size cuts it."""
REQUESTS = [
    _req([1, 2, 3, 4, 5], 1.0, 11),
    _req([10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110], 0.7, 12),
    _req(LONG, 1.0, 13),
    _req(PREFIX + [400, 401, 402], 0.7, 14),
    _req([900, 901, 902], 1.0, 15),
]
ALONE = [{"requests": [r]} for r in REQUESTS]
COBATCH = {"requests": REQUESTS}
SHARED = {
    "requests": [
        _req(PREFIX + [500, 501], 1.0, 16),
        _req(PREFIX + [600], 0.7, 17),
        # request 3 of batch 3 (PREFIX + ...) continued by its first 6 sampled tokens
        _req([700, 701], 1.0, 18, extend_of=[3, 0, 6]),
    ]
}
BATCHES = [*ALONE, COBATCH, SHARED]
"""batches 0-4: each request alone; 5: all co-batched; 6: shared prefixes and a continuation."""
GREEDY = [{"requests": [{**r, "temperature": 0.0} for r in b["requests"]]} for b in BATCHES]
"""BATCHES at temperature 0, for the stock controls: the stock sampler ignores `sampling_seed`,
so two stock engines sample other tokens; greedy, they pick the same ones until a logit's bits
flip an argmax, and the log-probs (log_softmax of the logits) of that common prefix differ
only by the ops."""
STOCK_DTYPE = "float32"
"""The stock engines' dtype: in bf16 SGLang's CPU ops gave every greedy log-prob of this plan
the same bits alone and co-batched (0 of 50 differ), so that control could not break there."""
MIN_COMPARED = 0.5
"""A stock control must compare at least this share of its tokens (the common greedy prefix)."""


def _runs(layout: str) -> list[dict]:
    tp, ep = LAYOUTS[layout]

    def spec(name, dtype, **engine):
        return {"name": name, "engine": {"tp": tp, "ep": ep, "dtype": dtype,
                "chunked_prefill_size": -1, "disable_radix_cache": True, **engine},
                "batches": BATCHES}  # fmt: skip

    runs = [spec(f"main-{d}", d) for d in DTYPES]
    if layout == "tp1":
        runs.append(spec("chunk1-bfloat16", "bfloat16", chunked_prefill_size=1))
        runs += [spec(f"chunk7-radix-{d}", d, chunked_prefill_size=7, disable_radix_cache=False)
                 for d in DTYPES]  # fmt: skip
        # sampled batches for decode == score (each sequence against its own score), greedy
        # ones for the engine-vs-engine controls
        runs.append({**spec("stock", STOCK_DTYPE), "greedy": GREEDY, "stock": True})
        runs.append({**spec("stock-chunk7-radix", STOCK_DTYPE, chunked_prefill_size=7,
                            disable_radix_cache=False), "batches": [], "greedy": GREEDY,
                     "stock": True})  # fmt: skip
    if layout == "tp2-ep2":
        runs.append({**spec("stock", STOCK_DTYPE), "batches": [], "greedy": GREEDY,
                     "stock": True})  # fmt: skip
    if layout == "tp2":
        runs.append(spec("chunk7-radix-bfloat16", "bfloat16", chunked_prefill_size=7,
                         disable_radix_cache=False))  # fmt: skip
    return runs


def _env(tp: int, cache: Path, segments=None, cuda_kv_branch: bool = False) -> dict[str, str]:
    from onpolicy.rollout import engine_env

    overlay = [str(REPO / "build" / "upstream" / "sglang")] if _overlay() else []
    overlay += [str(CUDA_KV_BRANCH)] if cuda_kv_branch else []
    path = [*overlay, str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
    env = {k: v for k, v in os.environ.items() if k != "ONPOLICY_K_SEGMENTS"}
    return {**env, **engine_env(tp, cache, segments=segments), "PYTHONPATH": os.pathsep.join(path)}


def _overlay() -> bool:
    """Use the patched git tree when the caller put it on PYTHONPATH (patch development)."""
    return "build/upstream/sglang" in os.environ.get("PYTHONPATH", "")


def _run_worker(plan: dict, tp: int, tmp: Path, cache: Path, timeout: float = 1500,
                segments=None, cuda_kv_branch: bool = False) -> dict:  # fmt: skip
    """The worker's results; `segments` (a `KSegments`) goes to its ONPOLICY_K_SEGMENTS, else
    the engines cut each row-parallel K into their own TP's segments. `cuda_kv_branch`: SGLang's
    fused-KV-write decision takes its CUDA branch in every process (CUDA_KV_BRANCH)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(json.dumps(plan))
    out = tmp / "result.json"
    cmd = [sys.executable, str(WORKER), "--plan", str(tmp / "plan.json"), "--out", str(out)]
    env = _env(tp, cache, segments, cuda_kv_branch)
    if cuda_kv_branch:
        env["ONPOLICY_CUDA_KV_BRANCH_LOG"] = str(tmp / "cuda-kv-branch.pids")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"exact SGLang worker (tp={tp}) exited {p.returncode}\n{p.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine_runs(tiny_checkpoint, tmp_path_factory, compile_cache):
    """layout -> run name -> results; each layout's worker runs once, when first asked for."""

    @functools.cache
    def get(layout: str) -> dict:
        plan = {"ckpt": str(tiny_checkpoint), "runs": _runs(layout)}
        tmp = tmp_path_factory.mktemp(f"sglang-exact-{layout}")
        res = _run_worker(plan, LAYOUTS[layout][0], tmp, compile_cache,
                          cuda_kv_branch=layout in CUDA_KV_LAYOUTS)["runs"]  # fmt: skip
        for name, r in res.items():
            print(f"[{layout} {name}] engine start + plan: {r['seconds']:.1f} s ({r['sglang']})")
        if layout in CUDA_KV_LAYOUTS:
            res["cuda_kv_branch_pids"] = (tmp / "cuda-kv-branch.pids").read_text().split()
        return res

    return get


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """dtype -> the reference model on the tiny checkpoint."""
    from onpolicy.models.reference import Qwen3MoeReference

    @functools.cache
    def get(dtype: str):
        return Qwen3MoeReference.from_pretrained(tiny_checkpoint, getattr(torch, dtype))

    return get


def _bits(answer: dict) -> torch.Tensor:
    return torch.tensor(answer["logprob_bits"], dtype=torch.int64).to(torch.int32)


def _f32(answer: dict) -> torch.Tensor:
    return _bits(answer).view(torch.float32)


def _answers(run: dict) -> list[tuple[dict, dict]]:
    """(request, answer) of every request of the run's plan, in plan order."""
    return [(req, ans) for batch, answers in zip(BATCHES, run["batches"], strict=True)
            for req, ans in zip(batch["requests"], answers, strict=True)]  # fmt: skip


def _score_mismatches(run: dict, model) -> tuple[int, int, list[str]]:
    """(differing, compared) sampled log-probs of the run against model.score, with reports."""
    bad, total, reports = 0, 0, []
    for req, ans in _answers(run):
        prompt = ans["prompt"]
        assert len(ans["output_ids"]) == NEW and ans["logprob_tokens"] == ans["output_ids"]
        want = model.score([prompt + ans["output_ids"]], req["temperature"])[0][len(prompt) - 1 :]
        got = _f32(ans)
        d = n_differ(got, want)
        bad, total = bad + d, total + len(want)
        if d:
            reports.append(f"T={req['temperature']} prompt len {len(prompt)}: "
                           + mismatch_report(got, want))  # fmt: skip
    return bad, total, reports


CASES = [pytest.param(lay, d, id=f"{lay}-{d}") for lay in LAYOUTS for d in DTYPES]


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype", CASES)
def test_sampled_logprobs_equal_reference_score(engine_runs, reference, layout, dtype):
    run = engine_runs(layout)[f"main-{dtype}"]
    bad, total, reports = _score_mismatches(run, reference(dtype))
    temps = {req["temperature"] for req, _ in _answers(run)}
    print(f"[{layout} {dtype}] decode == score: {total - bad}/{total} tokens equal, T in {temps}")
    assert temps == {1.0, 0.7}
    if layout in CUDA_KV_LAYOUTS:  # every TP rank's scheduler took the CUDA branch
        assert len(set(engine_runs(layout)["cuda_kv_branch_pids"])) >= LAYOUTS[layout][0]
    assert bad == 0, f"{layout} {dtype}: {bad}/{total} log-probs differ\n" + "\n".join(reports)


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype", CASES)
def test_seeded_tokens_equal_reference_generation(engine_runs, reference, layout, dtype):
    from onpolicy.models.reference import PagedKVCache, Request

    model = reference(dtype)
    equal = total = 0
    for req, ans in _answers(engine_runs(layout)[f"main-{dtype}"])[: len(REQUESTS)]:
        r = Request(rid=0, prompt=ans["prompt"], temperature=req["temperature"], seed=req["seed"])
        cache = PagedKVCache(model.cfg, model.dtype, page_size=16, num_pages=16)
        model.prefill([r], cache)
        for _ in range(NEW - 1):
            model.decode([r], cache)
        equal += sum(a == b for a, b in zip(r.output, ans["output_ids"], strict=True))
        total += NEW
        assert r.output == ans["output_ids"], f"seed {req['seed']}: {ans['output_ids']}"
    print(f"[{layout} {dtype}] seeded tokens == reference generation: {equal}/{total}")


def _compare(a: dict, b: dict) -> tuple[int, int, int, int]:
    """(tokens equal, tokens compared, log-prob bits equal, compared) of two answers."""
    n = len(a["output_ids"])
    tok = sum(x == y for x, y in zip(a["output_ids"], b["output_ids"], strict=True))
    return tok, n, n - n_differ(_bits(a), _bits(b)), n


def _alone_vs_cobatched(run: dict) -> list[tuple[int, int, int, int]]:
    """Per request: `_compare` of its answer alone and co-batched with the others."""
    batches = run["batches"]
    alone, together = [b[0] for b in batches[: len(REQUESTS)]], batches[len(REQUESTS)]
    return [_compare(a, b) for a, b in zip(alone, together, strict=True)]


def _run_vs_run(a: dict, b: dict) -> list[tuple[int, int, int, int]]:
    """Per request of the plan: `_compare` of two engines' answers."""
    return [_compare(x, y) for (_, x), (_, y) in zip(_answers(a), _answers(b), strict=True)]


def _totals(counts) -> tuple[int, int, int, int]:
    return tuple(sum(c[i] for c in counts) for i in range(4))


def _greedy_prefixes(a: list[list[dict]], b: list[list[dict]]) -> tuple[int, int, int]:
    """(log-probs differing, compared, tokens) of two stock engines' greedy answers to the same
    requests, compared only where the two contexts are the same: the same prompt (a
    continuation's prompt holds earlier sampled tokens) and the tokens before the first that
    differs, so only the ops can make their bits differ."""
    bad = compared = tokens = 0
    for x, y in zip((t for batch in a for t in batch), (t for batch in b for t in batch),
                    strict=True):  # fmt: skip
        tokens += len(x["output_ids"])
        if x["prompt"] != y["prompt"]:
            continue
        same = [p == q for p, q in zip(x["output_ids"], y["output_ids"], strict=True)]
        n = same.index(False) if False in same else len(same)
        bad, compared = bad + n_differ(_bits(x)[:n], _bits(y)[:n]), compared + n
    return bad, compared, tokens


def _assert_control_breaks(what: str, bad: int, compared: int, tokens: int) -> None:
    print(f"[stock {STOCK_DTYPE} {what}] greedy common prefix: {compared}/{tokens} compared, "
          f"{bad} log-probs differ")  # fmt: skip
    assert compared >= MIN_COMPARED * tokens, (
        f"{what}: only {compared}/{tokens} tokens in the common greedy prefix "
        f"(need {MIN_COMPARED:.0%}); the control compares too little"
    )
    assert bad > 0, f"{what}: the stock engines agreed on all {compared} compared log-probs"


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype", CASES)
def test_batch_invariance(engine_runs, layout, dtype):
    assert len({len(r["prompt"]) for r in REQUESTS}) == len(REQUESTS)  # other lengths
    counts = _alone_vs_cobatched(engine_runs(layout)[f"main-{dtype}"])
    tok, n_tok, lp, n_lp = _totals(counts)
    print(f"[{layout} {dtype}] alone vs co-batched: tokens {tok}/{n_tok}, bits {lp}/{n_lp}")
    assert (tok, lp) == (n_tok, n_lp), f"{layout} {dtype}: per request {counts}"


SWEEPS = [pytest.param("tp1", "chunk1-bfloat16", "bfloat16", id="tp1-chunk1-bfloat16")] + [
    pytest.param("tp1", f"chunk7-radix-{d}", d, id=f"tp1-chunk7-radix-{d}") for d in DTYPES] + [
    pytest.param("tp2", "chunk7-radix-bfloat16", "bfloat16", id="tp2-chunk7-radix-bfloat16")
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("layout, name, dtype", SWEEPS)
def test_chunked_prefill_and_radix_cache_give_the_same_bits(engine_runs, layout, name, dtype):
    """Every request of the plan equals the main engine's (chunking off, radix cache off)."""
    runs = engine_runs(layout)
    swept, main = runs[name], runs[f"main-{dtype}"]
    counts = _run_vs_run(swept, main)
    tok, n_tok, lp, n_lp = _totals(counts)
    cached = [a["cached_tokens"] for a in swept["batches"][-1]]
    print(f"[{layout} {name}] vs main: tokens {tok}/{n_tok}, bits {lp}/{n_lp}, "
          f"cached prompt tokens of the shared-prefix batch {cached}")  # fmt: skip
    if "radix" in name:  # the check can fail only if the cache really served these prompts
        assert all(c >= len(PREFIX) for c in cached), f"radix cache not hit: {cached}"
    assert (tok, lp) == (n_tok, n_lp), f"{layout} {name}: per request {counts}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["tp2", "tp2-ep2"])
def test_tp1_equals_tp2(engine_runs, tiny_checkpoint, layout, dtype):
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.rollout import check_tp

    cfg = Qwen3MoeConfig.from_hf(tiny_checkpoint)
    tp, ep = LAYOUTS[layout]
    # Where the contract allows it: check_tp raises for a TP whose sums are not exact.
    check_tp(tp, ep, cfg.num_attention_heads, cfg.head_dim, cfg.moe_intermediate_size)
    counts = _run_vs_run(engine_runs("tp1")[f"main-{dtype}"], engine_runs(layout)[f"main-{dtype}"])
    tok, n_tok, lp, n_lp = _totals(counts)
    print(f"[tp1 vs {layout} {dtype}] tokens {tok}/{n_tok}, bits {lp}/{n_lp}")
    assert (tok, lp) == (n_tok, n_lp), f"tp1 vs {layout} {dtype}: per request {counts}"


@pytest.mark.slow
def test_stock_path_breaks_decode_equals_score(engine_runs, reference):
    """The same plan and the same comparison on SGLang's own ops must fail it."""
    bad, total, _ = _score_mismatches(engine_runs("tp1")["stock"], reference(STOCK_DTYPE))
    print(f"[tp1 {STOCK_DTYPE} stock] decode == score: {total - bad}/{total} tokens equal")
    assert bad > 0, f"the stock path matched the reference on all {total} log-probs"


@pytest.mark.slow
def test_stock_path_breaks_tp1_equals_tp2(engine_runs):
    """The TP harness on the stock engines (TP1 vs TP2 EP2, greedy) must find differing bits."""
    a, b = engine_runs("tp1")["stock"], engine_runs("tp2-ep2")["stock"]
    _assert_control_breaks("tp1 vs tp2-ep2", *_greedy_prefixes(a["greedy"], b["greedy"]))


@pytest.mark.slow
def test_stock_path_breaks_batch_invariance(engine_runs):
    """The batch-invariance harness on the stock engine (greedy) must find differing bits."""
    greedy = engine_runs("tp1")["stock"]["greedy"]
    alone, together = [b[0] for b in greedy[: len(REQUESTS)]], greedy[len(REQUESTS)]
    _assert_control_breaks("tp1 alone vs co-batched",
                           *_greedy_prefixes([alone], [together]))  # fmt: skip


@pytest.mark.slow
def test_stock_path_breaks_chunk_and_cache_invariance(engine_runs):
    """The chunk/radix harness on the stock engine (chunk 7, radix on vs both off, greedy) must
    fail."""
    runs = engine_runs("tp1")
    swept = runs["stock-chunk7-radix"]["greedy"]
    cached = [a["cached_tokens"] for a in swept[-1]]
    print(f"[tp1 stock chunk7-radix] cached prompt tokens of the shared batch {cached}")
    assert all(c >= len(PREFIX) for c in cached), f"radix cache not hit: {cached}"
    _assert_control_breaks("tp1 chunk7-radix vs main",
                           *_greedy_prefixes(swept, runs["stock"]["greedy"]))  # fmt: skip


# --- refusals -----------------------------------------------------------------------------------
REFUSALS = {
    "torch_native": ({"attention_backend": "torch_native"}, "rollout_attention_backend"),
    "decode_backend": ({"decode_attention_backend": "torch_native"}, "rollout_attention_backend"),
    "speculative": ({"speculative_algorithm": "NGRAM"}, "rollout_no_speculative_decoding"),
    "cuda_graphs": ({"disable_cuda_graph": False}, "rollout_cuda_graphs"),
    "dtype_auto": ({"dtype": "auto"}, "dtype"),
}
"""case -> (engine arguments over the exact ones, the rule the refusal must name)."""


@pytest.mark.slow
def test_engine_refuses_settings_off_the_exact_path(tiny_checkpoint, tmp_path, compile_cache):
    from onpolicy.segments import KSegments

    cases = {name: args for name, (args, _) in REFUSALS.items()}
    plan = {"ckpt": str(tiny_checkpoint), "refuse": cases}
    got = _run_worker(plan, 1, tmp_path / "w1", compile_cache)["refusals"]
    # A TP2 EP1 engine (MoE TP 2) in a run whose other side leaves the experts whole: S = 1, so
    # the engine's two shards of the expert K would split its one segment.
    run = KSegments(attention=2, experts=1)
    got |= _run_worker({"ckpt": str(tiny_checkpoint), "refuse": {"inexact_tp": {"tp": 2}}}, 2,
                       tmp_path / "w2", compile_cache, segments=run)["refusals"]  # fmt: skip
    rules = {name: rule for name, (_, rule) in REFUSALS.items()} | {
        "inexact_tp": "expert_k_segments"
    }
    for name, rule in rules.items():
        print(f"[refuse {name}] {got[name].splitlines()[0]}")
        assert f"[{rule}]" in got[name], f"{name}: expected a [{rule}] refusal, got {got[name]}"


@pytest.mark.slow
def test_expert_k_that_the_block_tree_could_not_split_is_exact_in_segments(tmp_path, compile_cache):
    """moe_intermediate_size 192 (a 128-block and a 64-wide one) at MoE TP 2 (TP2 EP1): 96-wide
    shards are no subtree of that block tree, so one tree over K was refused here. The run cuts
    it into S = 2 segments (ONPOLICY_K_SEGMENTS), one a rank: the sampled log-probs equal the
    reference's `score` at the same S. Control: the reference at S = 1 (the unsplit tree)
    differs. 192 is a multiple of TP x 32, so SGLang's CPU runner does not pad it. In fp32: in
    bf16 each expert output's rounding hides the two trees' last-bit difference on this model
    (the reference's bf16 log-probs at S = 1 and 2 were the same bits), so the control could
    not fail there."""
    from onpolicy.models import write_tiny_checkpoint
    from onpolicy.models.reference import Qwen3MoeReference
    from onpolicy.models.tiny import tiny
    from onpolicy.segments import KSegments

    ckpt = write_tiny_checkpoint(tmp_path / "k192", tiny(moe_intermediate_size=192), seed=0)
    run = KSegments(attention=2, experts=2)
    engine = {"tp": 2, "ep": 1, "dtype": "float32", "chunked_prefill_size": -1,
              "disable_radix_cache": True}  # fmt: skip
    spec = {"name": "k192", "engine": engine, "batches": [COBATCH]}
    res = _run_worker({"ckpt": str(ckpt), "runs": [spec]}, 2, tmp_path / "w", compile_cache,
                      segments=run)  # fmt: skip
    answers = list(zip(COBATCH["requests"], res["runs"]["k192"]["batches"][0], strict=True))
    counts = {}
    for name, segments in {"S=2": run, "S=1": KSegments(attention=2, experts=1)}.items():
        model = Qwen3MoeReference.from_pretrained(ckpt, torch.float32, segments=segments)
        bad = total = 0
        for req, ans in answers:
            prompt = ans["prompt"]
            want = model.score([prompt + ans["output_ids"]], req["temperature"])[0]
            d = n_differ(_f32(ans), want[len(prompt) - 1 :])
            bad, total = bad + d, total + NEW
        counts[name] = (bad, total)
    print(f"[k192 tp2-ep1 fp32] differing sampled log-probs vs the reference: {counts}")
    assert counts["S=2"][0] == 0, counts
    assert counts["S=1"][0] > 0, counts


def test_check_tp_holds_the_engine_to_the_runs_segments():
    """Qwen3-30B-A3B's expert K = 768 at MoE TP 2: exact in S = 2 segments of 384 (what an
    engine alone takes, its own TP) or S = 4; refused where the run cuts that K into S = 1
    (its other side leaves the experts whole), and where the engine's TP exceeds the run's S."""
    from onpolicy.contract import ContractError
    from onpolicy.rollout import check_tp
    from onpolicy.segments import KSegments

    check_tp(2, 2, 32, 128, 768)  # MoE TP 1: experts whole
    check_tp(2, 1, 32, 128, 768)  # S = the engine's own TP 2
    check_tp(2, 1, 32, 128, 768, KSegments(attention=2, experts=2))
    check_tp(2, 1, 32, 128, 768, KSegments(attention=8, experts=4))  # 2 segments a rank
    with pytest.raises(ContractError, match=r"expert_k_segments.*768 into 2 shards, but the "
                       r"run cuts it into S = 1 segments \(ONPOLICY_K_SEGMENTS=attention=2,"
                       r"experts=1\)"):  # fmt: skip
        check_tp(2, 1, 32, 128, 768, KSegments(attention=2, experts=1))
    with pytest.raises(ContractError, match=r"attention_k_segments.*4096 into 4 shards.*S = 2"):
        check_tp(4, 4, 32, 128, 768, KSegments(attention=2, experts=1))
    with pytest.raises(ContractError, match=r"expert_k_segments.*33 into 2 shards.*its own TP"):
        check_tp(2, 1, 32, 128, 33, device="cuda")
    with pytest.raises(ContractError, match="power_of_2_groups"):
        check_tp(3, 1, 32, 128, 768)
    # SGLang's CPU runner pads the expert K to a multiple of TP x 32 and cuts the padded K: a
    # power of 2 keeps the tree, 48 would not; on CUDA nothing is padded.
    check_tp(2, 1, 4, 16, 32)
    with pytest.raises(ContractError, match=r"expert_k_segments.*pads moe_intermediate_size = "
                       r"48 to 64"):  # fmt: skip
        check_tp(2, 2, 4, 16, 48)
    check_tp(2, 1, 4, 16, 48, device="cuda")
