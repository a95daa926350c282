"""One SGLang Engine on CPU answering a plan of requests, some outside the exact sampling rule.

Each request is sent alone, through `Engine.generate`; the worker records, per request, the
error it raised (type and text) or its tokens and the float32 bits of its sampled log-probs.
The plan's `stock` flag starts the stock engine (no `rl_on_policy_target`) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def f32_bits(x: float) -> int:
    """The float32 bit pattern of a log-prob SGLang returned (a widened float32)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def answer(engine, req: dict) -> dict:
    """The request's answer, or the error `generate` raised for it."""
    try:
        out = engine.generate(input_ids=req["prompt"], sampling_params=req["params"],
                              return_logprob=True)  # fmt: skip
    except Exception as e:  # the refusal under test; any other error is recorded too
        return {"error": f"{type(e).__name__}: {e}"}
    if "error" in out.get("meta_info", {}):
        return {"error": str(out["meta_info"]["error"])}
    lps = out["meta_info"]["output_token_logprobs"]
    return {
        "output_ids": out["output_ids"],
        "logprob_bits": [f32_bits(lp) for lp, _t, _x in lps],
        "logprob_tokens": [t for _lp, t, _x in lps],
    }


def warm_up(engine, max_tokens: int, last: dict) -> dict:
    """`rollout.warmup` on this engine: its limits and the prompts `launch` would run (counted),
    a warm-up of up to `max_tokens` run, then the plan's last request answered again."""
    from onpolicy.rollout.warmup import engine_prompts, prefill_limits, warm_up_engine

    limits = prefill_limits(engine.get_server_info())
    full = engine_prompts(engine)
    batches = engine_prompts(engine, seed=3, max_tokens=max_tokens)
    w = warm_up_engine(engine, batches)
    return {"max_tokens": limits.max_tokens, "max_prompt": limits.max_prompt,
            "launch_prompts": sum(map(len, full)), "launch_batches": len(full),
            "batches": w.batches, "prompts": w.prompts, "tokens": w.tokens,
            "sent": [[len(p) for p in b] for b in batches], "seconds": w.seconds,
            "after": answer(engine, last)}  # fmt: skip


def main(args: argparse.Namespace) -> None:
    import sglang as sgl
    from onpolicy.rollout import exact_engine_args

    plan = json.loads(open(args.plan).read())
    engine_args = exact_engine_args(plan["ckpt"], tp=1, dtype="bfloat16")
    if plan.get("stock"):  # the negative control: the same engine without the switch
        del engine_args["rl_on_policy_target"]
        engine_args["attention_backend"] = "torch_native"
    t0 = time.monotonic()
    engine = sgl.Engine(**engine_args)
    started = time.monotonic() - t0
    warm = {}
    try:
        answers = [answer(engine, r) for r in plan["requests"]]
        if plan.get("warm_up_tokens"):
            warm = warm_up(engine, plan["warm_up_tokens"], plan["requests"][-1])
    finally:
        engine.shutdown()
    result = {"answers": answers, "start_seconds": started, "warm_up": warm,
              "seconds": time.monotonic() - t0, "sglang": sgl.__file__}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    main(ap.parse_args())
