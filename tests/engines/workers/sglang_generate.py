"""One patched SGLang Engine on CPU: greedy and sampled generation, written as JSON.

Run as a subprocess per case: SGLANG_USE_CPU_ENGINE must be set before sglang is imported,
and every case gets a fresh engine with its own scheduler processes.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def main(args: argparse.Namespace) -> None:
    import sglang as sgl

    engine = sgl.Engine(
        model_path=args.ckpt,
        device="cpu",
        attention_backend="torch_native",
        dtype="float32",
        tp_size=args.tp,
        ep_size=args.ep,
        disable_cuda_graph=True,
        # The KV pool is max_total_tokens; at a fraction of 0.05 the start failed whenever
        # other jobs held the host's memory (rollout.engine's CPU setting, for the same reason).
        mem_fraction_static=0.99,
        max_total_tokens=4096,
        random_seed=1234,
        log_level="error",
    )
    try:
        prompts = json.loads(args.prompts)
        greedy = engine.generate(
            input_ids=prompts,
            sampling_params={
                "temperature": 0.0,
                "max_new_tokens": args.new_tokens,
                "ignore_eos": True,
            },
        )
        sampled = engine.generate(
            input_ids=prompts,
            sampling_params={
                "temperature": 1.0,
                "max_new_tokens": args.new_tokens,
                "ignore_eos": True,
            },
            return_logprob=True,
        )
        text = engine.generate(prompt="kalo rite mon", sampling_params={"max_new_tokens": 4})
    finally:
        engine.shutdown()
    result = {
        "greedy": [g["output_ids"] for g in greedy],
        "sampled": [
            {
                "output_ids": s["output_ids"],
                "logprobs": [lp for lp, _tok, _txt in s["meta_info"]["output_token_logprobs"]],
                "logprob_tokens": [t for _lp, t, _txt in s["meta_info"]["output_token_logprobs"]],
            }
            for s in sampled
        ],
        "text": text["text"],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompts", default="[[1, 2, 3, 4], [10, 20, 30], [500, 600, 700, 800, 900]]")
    main(ap.parse_args())
