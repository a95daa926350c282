"""One exact SGLang Engine (rl_on_policy_target="onpolicy") on CPU: every request of a plan,
answered and written as JSON.

The plan (JSON) names the engine arguments and a list of generate calls; each call is a
batch of requests (token ids, temperature, seed, max_new_tokens). The worker answers them in
order, one `generate` per batch, and records tokens and the float32 bits of every sampled
log-prob. `--refuse` instead starts engines that must be refused and records the errors.
"""

from __future__ import annotations

import argparse
import json
import os
import struct

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def f32_bits(x: float) -> int:
    """The float32 bit pattern of a log-prob SGLang returned (a widened float32)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def run_batches(engine, batches: list[dict]) -> list[list[dict]]:
    results = []
    for batch in batches:
        params = [
            {"temperature": r["temperature"], "max_new_tokens": r["new_tokens"],
             "sampling_seed": r["seed"], "ignore_eos": True}
            for r in batch["requests"]
        ]  # fmt: skip
        outs = engine.generate(input_ids=[r["prompt"] for r in batch["requests"]],
                               sampling_params=params, return_logprob=True)  # fmt: skip
        if batch.get("flush"):
            engine.flush_cache()
        answers = []
        for o in outs:
            lps = o["meta_info"]["output_token_logprobs"]
            answers.append({
                "output_ids": o["output_ids"],
                "logprob_bits": [f32_bits(lp) for lp, _t, _x in lps],
                "logprob_tokens": [t for _lp, t, _x in lps],
                "cached_tokens": o["meta_info"].get("cached_tokens", 0),
            })  # fmt: skip
        results.append(answers)
    return results


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


def main(args: argparse.Namespace) -> None:
    plan = json.loads(open(args.plan).read())
    if plan.get("refuse"):
        result = {"refusals": refusals(plan["ckpt"], plan["refuse"])}
    else:
        import sglang as sgl
        from onpolicy.rollout import exact_engine_args

        engine_args = exact_engine_args(plan["ckpt"], **plan["engine"])
        if plan.get("stock"):  # the negative control: the same engine on SGLang's own ops
            for k in ("rl_on_policy_target",):
                engine_args.pop(k)
            engine_args["attention_backend"] = "torch_native"
        engine = sgl.Engine(**engine_args)
        try:
            result = {"batches": run_batches(engine, plan["batches"]),
                      "sglang": sgl.__file__}  # fmt: skip
        finally:
            engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    main(ap.parse_args())
