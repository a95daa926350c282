"""The rollout side of `onpolicy parity`: one SGLang engine samples prompts, with log-probs.

Runs in its own process (`python -m onpolicy.parity_rollout`): SGLANG_USE_CPU_ENGINE must be
set before sglang is imported, and `Engine.shutdown()` kills every descendant of the process
that made the engine, so the engine never lives in the driver. The weight-update tests reuse
`launch`, `engine_env` and `sample`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(kw_only=True, slots=True)
class RolloutRequest:
    """What one rollout samples: prompts, lengths, temperature, seed."""

    prompts: list[list[int]]
    """Prompt token ids, one list per sample."""
    new_tokens: int
    """Tokens to generate per prompt (EOS is ignored, so every sample has exactly this many)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    seed: int = 0
    """Base sampling seed; sample i uses seed + i."""
    return_routed_experts: bool = False
    """Also return each sample's routed expert ids (the engine must have been started with
    return_routed_experts=True): field "routed_experts", `onpolicy.rollout.routing.encode` of
    int32 [len(prompt) + new_tokens - 1, layers, top_k]; `routing.decode` reads it."""


def engine_env(tp: int, cache_dir: str | os.PathLike, base: dict[str, str] | None = None) -> dict:
    """`base` (default: this process's environment) plus what an engine process needs before
    `import sglang` (`onpolicy.rollout.engine_env`)."""
    from onpolicy.rollout import engine_env as rollout_env

    return {**(base if base is not None else os.environ), **rollout_env(tp, cache_dir)}


def engine_kwargs(ckpt: str, tp: int, ep: int, dtype: str, exact: bool = True, **extra) -> dict:
    """`sglang.Engine(**kwargs)` for one CPU engine; `exact` routes every op to onpolicy.kernels,
    otherwise the same engine runs SGLang's stock CPU path (torch_native; the negative control).
    `extra`: further `exact_engine_args` keywords."""
    from onpolicy.rollout import exact_engine_args

    kwargs = exact_engine_args(ckpt, tp=tp, ep=ep, dtype=dtype, **extra)
    if not exact:
        del kwargs["rl_on_policy_target"]
        kwargs["attention_backend"] = "torch_native"
    return kwargs


def launch(ckpt: str, tp: int, ep: int, dtype: str, exact: bool = True, **extra):
    """A started `sglang.Engine` (call `.shutdown()` when done)."""
    import sglang as sgl

    return sgl.Engine(**engine_kwargs(ckpt, tp, ep, dtype, exact, **extra))


def sample(engine, req: RolloutRequest) -> list[dict]:
    """Generate every prompt in one batch; per sample its output ids, fp32 log-probs (widened to
    Python floats, which is exact) and the weight version the engine reported; with
    `req.return_routed_experts` also "routed_experts" (see `RolloutRequest`)."""
    params = [
        {"temperature": req.temperature, "max_new_tokens": req.new_tokens, "ignore_eos": True,
         "sampling_seed": req.seed + i}
        for i in range(len(req.prompts))
    ]  # fmt: skip
    extra = {"return_routed_experts": True} if req.return_routed_experts else {}
    outs = engine.generate(input_ids=req.prompts, sampling_params=params, return_logprob=True,
                           **extra)  # fmt: skip
    result = []
    for prompt, out in zip(req.prompts, outs, strict=True):
        meta = out["meta_info"]
        lps = meta["output_token_logprobs"]
        ids = [t for _lp, t, _txt in lps]
        if ids != out["output_ids"] or len(ids) != req.new_tokens:
            raise RuntimeError(
                f"engine returned {len(out['output_ids'])} tokens with {len(ids)} log-probs for "
                f"prompt {prompt}; wanted {req.new_tokens} of each, for the same tokens"
            )
        result.append({"prompt": prompt, "output_ids": ids, "logprobs": [lp for lp, _t, _x in lps],
                       "weight_version": meta.get("weight_version")})  # fmt: skip
        if req.return_routed_experts:
            result[-1]["routed_experts"] = _routes(engine, meta)
    return result


def _routes(engine, meta: dict) -> dict:
    """A response's routed expert ids, checked against the model's shape, JSON-safe."""
    from onpolicy.rollout import routing

    hf = engine.tokenizer_manager.model_config.hf_text_config
    return routing.encode(routing.routed_experts(meta, hf.num_hidden_layers,
                                                 hf.num_experts_per_tok))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.parity_rollout", description=__doc__)
    ap.add_argument("--ckpt", required=True, help="HF checkpoint folder")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stock", action="store_true", help="SGLang's stock CPU path, not the exact")
    ap.add_argument("--request", required=True, help="JSON file of a RolloutRequest")
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    args = ap.parse_args(argv)
    req = RolloutRequest(**json.loads(Path(args.request).read_text()))
    engine = launch(args.ckpt, args.tp, args.ep, args.dtype, exact=not args.stock)
    try:
        samples = sample(engine, req)
    finally:
        engine.shutdown()
    import sglang

    result = {"request": asdict(req), "samples": samples, "sglang": sglang.__file__}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
