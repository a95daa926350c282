"""The exact rollout: SGLang's Qwen3-MoE forward and sampler routed through onpolicy.

One switch turns it on: `rl_on_policy_target="onpolicy"` (with `attention_backend="onpolicy"`).
The patched SGLang (patches/sglang) then sends every op of the model to `onpolicy.kernels`
(`ops`, `moe`, the `attention` backend), every TP/EP sum to `onpolicy.collectives`, and
sampling to the reference model's rule (`sampler`); `switch.check` refuses, at Engine start,
any setting that would leave that path. Sampled log-probs then equal
`onpolicy.models.reference.Qwen3MoeReference.score` bit for bit, the reference built with the
same K segments as the engine (`onpolicy.segments`; the run's are `contract.k_segments(cfg)`).

`engine` is the one place that starts an engine and samples from it (a fresh process; the
environment must be set before `import sglang`):

    env = engine_env(tp=2, run_dir="runs/x", segments=contract.k_segments(cfg),
                     base=os.environ)                              # for the engine's process
    # in that process:
    engine = launch("path/to/hf-checkpoint", tp=2, ep=2, dtype="bfloat16")
    samples = sample(engine, RolloutRequest(prompts=[[1, 2, 3]], new_tokens=16,
                                            temperature=0.7, seed=7))

or pass `exact_engine_args(path, ...)` to `sglang.Engine` yourself. Sample i's tokens are those
of `reference.Request(rid=0, seed=its sampling seed, ...)` sampled by `sampling.sample_rows` (the
seed: `seeds[i]`, or `seed + i`). `host` serves
one engine in its own process (`EngineService`, `EngineClient`); both, and the GRPO run's
`EngineProxy`, are an `EngineHandle`: what the driver and the weight sync ask of an engine.
"""

from onpolicy.rollout.engine import (
    EngineHandle,
    EngineOp,
    RolloutRequest,
    engine_env,
    engine_kwargs,
    exact_engine_args,
    launch,
    sample,
)
from onpolicy.rollout.switch import ATTENTION_BACKEND, DTYPES, TARGET, check, check_tp

__all__ = [
    "ATTENTION_BACKEND", "DTYPES", "TARGET", "EngineHandle", "EngineOp", "RolloutRequest",
    "check", "check_tp", "engine_env", "engine_kwargs", "exact_engine_args", "launch", "sample",
]  # fmt: skip
