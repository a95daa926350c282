"""The exact rollout: SGLang's Qwen3-MoE forward and sampler routed through onpolicy.

One switch turns it on: `rl_on_policy_target="onpolicy"` (with `attention_backend="onpolicy"`).
The patched SGLang (patches/sglang) then sends every op of the model to `onpolicy.kernels`
(`ops`, `moe`, the `attention` backend), every TP/EP sum to `onpolicy.collectives`, and
sampling to the reference model's rule (`sampler`); `switch.check` refuses, at Engine start,
any setting that would leave that path. Sampled log-probs then equal
`onpolicy.models.reference.Qwen3MoeReference.score` bit for bit, the reference built with the
same K segments as the engine (`onpolicy.segments`; the run's are `contract.k_segments(cfg)`).

Start an exact engine (a fresh process; the environment must be set before `import sglang`):

    env = os.environ | engine_env(tp=2, run_dir="runs/x",         # for the engine's process
                                  segments=contract.k_segments(cfg))
    # in that process:
    engine = launch_engine("path/to/hf-checkpoint", tp=2, ep=2, dtype="bfloat16")
    out = engine.generate(input_ids=[[1, 2, 3]], return_logprob=True,
                          sampling_params={"temperature": 0.7, "max_new_tokens": 16,
                                           "sampling_seed": 7, "ignore_eos": True})

or pass `exact_engine_args(path, ...)` to `sglang.Engine` yourself. Request i's tokens are those
of `reference.Request(rid=0, seed=sampling_seed, ...)` sampled by `reference.sample`.
"""

from onpolicy.rollout.launch import engine_env, exact_engine_args, launch_engine
from onpolicy.rollout.switch import ATTENTION_BACKEND, DTYPES, TARGET, check, check_tp

__all__ = [
    "ATTENTION_BACKEND", "DTYPES", "TARGET", "check", "check_tp", "engine_env",
    "exact_engine_args", "launch_engine",
]  # fmt: skip
