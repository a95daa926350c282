"""Starting an exact SGLang engine: the environment and the Engine arguments, in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from onpolicy.rollout.switch import ATTENTION_BACKEND, TARGET
from onpolicy.segments import ENV as K_SEGMENTS_ENV
from onpolicy.segments import KSegments


def engine_env(tp: int, run_dir: str | os.PathLike, device: str = "cpu",
               segments: KSegments | None = None) -> dict[str, str]:  # fmt: skip
    """Environment variables a CPU engine process needs before `import sglang`.

    One OpenMP thread per TP rank, each bound to its own core (SGLang asserts ranks <= NUMA
    nodes without the binding), and SGLang's / inductor's caches under `run_dir`. `segments`
    (the run's `contract.k_segments`) goes to ONPOLICY_K_SEGMENTS; without it the engine cuts
    each row-parallel K into its own TP's segments.
    """
    run = Path(run_dir)
    env = {
        "SGLANG_CACHE_DIR": str(run / "sglang-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run / "inductor-cache"),
    }
    if segments is not None:
        env[K_SEGMENTS_ENV] = segments.env_value()
    if device == "cpu":
        cores = os.cpu_count() or 1
        env |= {
            "SGLANG_USE_CPU_ENGINE": "1",
            "OMP_NUM_THREADS": "1",
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(tp)),
        }
    return env


def exact_engine_args(
    model_path: str | os.PathLike, *, tp: int = 1, ep: int = 1, dtype: str = "bfloat16",
    device: str = "cpu", chunked_prefill_size: int | None = None,
    disable_radix_cache: bool = False, return_routed_experts: bool = False, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """`sglang.Engine(**kwargs)` arguments of an exact engine; `extra` adds or overrides.

    `chunked_prefill_size` None keeps SGLang's default, -1 turns chunking off; any size gives
    the same bits, as does the radix cache on or off. `return_routed_experts` turns on SGLang's
    routed-experts capture (`enable_return_routed_experts`): a request that asks for them then
    gets every token's expert ids (`onpolicy.rollout.routing.routed_experts`).
    """
    args: dict[str, Any] = {
        "model_path": str(model_path),
        "device": device,
        "rl_on_policy_target": TARGET,
        "attention_backend": ATTENTION_BACKEND,
        "dtype": dtype,
        "tp_size": tp,
        "ep_size": ep,
        "disable_cuda_graph": True,
        "page_size": 1,
        "disable_radix_cache": disable_radix_cache,
        "mem_fraction_static": 0.05,
        "max_total_tokens": 4096,
        "random_seed": 1234,
        "log_level": "error",
    }
    if chunked_prefill_size is not None:
        args["chunked_prefill_size"] = chunked_prefill_size
    if return_routed_experts:
        args["enable_return_routed_experts"] = True
    return args | extra


def launch_engine(model_path: str | os.PathLike, **kwargs: Any):
    """`sglang.Engine` on the exact path (see `exact_engine_args` for the keywords).

    The process must already carry `engine_env(tp, run_dir)`: SGLang reads
    SGLANG_USE_CPU_ENGINE at import, so it cannot be set from here.
    """
    args = exact_engine_args(model_path, **kwargs)
    if args["device"] == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise RuntimeError(
            "launch_engine: SGLANG_USE_CPU_ENGINE is not 1 in this process; start it with "
            "onpolicy.rollout.engine_env(tp, run_dir) in its environment"
        )
    import sglang as sgl

    return sgl.Engine(**args)
