"""One exact SGLang Engine (rl_on_policy_target="onpolicy") on CPU: every request of a plan,
answered and written as JSON.

The plan (JSON) lists engine runs (arguments and generate calls, started one after the other in
this process); each call is a batch of requests (token ids, temperature, seed, new tokens),
answered by one `generate`; a run holds its batches under `batches` and, optionally, a second
list under `greedy`; the worker records tokens and the float32 bits of every sampled
log-prob. A plan with `refuse` instead starts engines that must be refused, recording the errors.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


PLANS = ("batches", "greedy")
"""The lists of batches a run spec may hold, answered in this order by the same engine."""


def f32_bits(x: float) -> int:
    """The float32 bit pattern of a log-prob SGLang returned (a widened float32)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def refusals(ckpt: str, cases: dict[str, dict]) -> dict[str, str]:
    """Each case's engine arguments must be refused at start; record the error text."""
    import sglang as sgl
    from onpolicy.rollout import exact_engine_args

    errors = {}
    for name, overrides in cases.items():
        try:
            engine = sgl.Engine(**exact_engine_args(ckpt, **overrides))
        except Exception as e:  # the refusal under test; anything else is reported too
            errors[name] = f"{type(e).__name__}: {e}"
        else:
            engine.shutdown()
            errors[name] = "STARTED"
    return errors


def resolve_prompt(req: dict, done: list[list[dict]], plan_batches: list[dict]) -> list[int]:
    """A request's prompt; `extend_of` [batch, request, n] continues an earlier request with
    its first n sampled tokens (so the radix cache holds decode-produced keys for it)."""
    if "extend_of" not in req:
        return req["prompt"]
    b, i, n = req["extend_of"]
    earlier = plan_batches[b]["requests"][i]
    return (
        resolve_prompt(earlier, done, plan_batches) + done[b][i]["output_ids"][:n] + req["prompt"]
    )


def run_batches(engine, batches: list[dict]) -> list[list[dict]]:
    results: list[list[dict]] = []
    for batch in batches:
        prompts = [resolve_prompt(r, results, batches) for r in batch["requests"]]
        params = [
            {"temperature": r["temperature"], "max_new_tokens": r["new_tokens"],
             "sampling_seed": r["seed"], "ignore_eos": True}
            for r in batch["requests"]
        ]  # fmt: skip
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        answers = []
        for prompt, o in zip(prompts, outs, strict=True):
            lps = o["meta_info"]["output_token_logprobs"]
            answers.append({
                "prompt": prompt,
                "output_ids": o["output_ids"],
                "logprob_bits": [f32_bits(lp) for lp, _t, _x in lps],
                "logprob_tokens": [t for _lp, t, _x in lps],
                "cached_tokens": o["meta_info"].get("cached_tokens", 0),
            })  # fmt: skip
        results.append(answers)
    return results


def run(ckpt: str, spec: dict) -> dict:
    """One engine: start it, answer its batches, shut it down."""
    import sglang as sgl
    from onpolicy.rollout import exact_engine_args

    args = exact_engine_args(ckpt, **spec["engine"])
    if spec.get("stock"):  # the negative control: the same engine on SGLang's own ops
        del args["rl_on_policy_target"]
        args["attention_backend"] = "torch_native"
    t0 = time.monotonic()
    engine = sgl.Engine(**args)
    try:  # each plan resolves its `extend_of` against its own batches
        plans = {key: run_batches(engine, spec[key]) for key in PLANS if key in spec}
    finally:
        engine.shutdown()
    return {**plans, "seconds": time.monotonic() - t0, "sglang": sgl.__file__}


def main(args: argparse.Namespace) -> None:
    plan = json.loads(open(args.plan).read())
    if "refuse" in plan:
        result = {"refusals": refusals(plan["ckpt"], plan["refuse"])}
    else:
        result = {"runs": {}}
        for spec in plan["runs"]:
            result["runs"][spec["name"]] = r = run(plan["ckpt"], spec)
            print(f"{spec['name']}: {r['seconds']:.1f} s", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    main(ap.parse_args())
