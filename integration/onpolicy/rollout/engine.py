"""The one place that starts an SGLang engine and samples from it, and what the system asks of one.

- `engine_env`: the environment a CPU engine process needs before `import sglang`;
- `exact_engine_args` / `engine_kwargs`: the `sglang.Engine` arguments (exact, or SGLang's stock
  CPU path, the negative control); `launch`: the started engine (with `warm_up`, its prefill's
  kernels compiled first, `rollout.warmup`);
- `RolloutRequest` and `sample`: generate a batch with fp32 log-probs (and routed experts);
- `EngineHandle`: the operations the rest of the system asks of one engine, by name, with the
  send-now / result-later transport the weight sync overlaps with its own collectives.
  `rollout.host.EngineService` (the engine in this process), `rollout.host.EngineClient` (a host
  process over a socket) and `grpo.actors.EngineProxy` (a Ray actor) implement it;
- `join_update_group` / `tensor_payloads`: the trainer's side of SGLang's two weight transports.

sglang is imported inside the functions that need it: SGLANG_USE_CPU_ENGINE must be set before
it is imported, and `Engine.shutdown()` kills every descendant of the process that made the
engine, so an engine lives in a process of its own (`rollout.host`, a rollout actor,
`python -m onpolicy.parity.rollout_worker`), never in a driver or trainer.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from onpolicy.rollout.switch import ATTENTION_BACKEND, TARGET
from onpolicy.segments import ENV as K_SEGMENTS_ENV
from onpolicy.segments import KSegments

# --- starting an engine ---------------------------------------------------------------------
MODEL_PACKAGE_ENV, MODEL_PACKAGE = "SGLANG_EXTERNAL_MODEL_PACKAGE", "onpolicy.rollout.models"


def engine_env(tp: int, run_dir: str | os.PathLike, device: str = "cpu", *,
               segments: KSegments | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    """Environment variables an engine process needs before `import sglang`; with `base` (e.g.
    `os.environ`), `base` plus them: the whole environment of the engine's process.

    On CPU, one OpenMP thread per TP rank, each bound to its own core (SGLang asserts ranks <=
    NUMA nodes without the binding). SGLang's / inductor's caches go under `run_dir`.
    `segments` (the run's `contract.k_segments`) goes to ONPOLICY_K_SEGMENTS; without it the
    engine cuts each row-parallel K into its own TP's segments (or keeps `base`'s value).
    """
    run = Path(run_dir)
    env = {
        "SGLANG_CACHE_DIR": str(run / "sglang-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run / "inductor-cache"),
        # The registry then imports only the model this project runs (rollout/models).
        MODEL_PACKAGE_ENV: MODEL_PACKAGE,
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
    elif device == "cuda":
        # SGLang's CUDA start asserts sglang-kernel's version; the exact path calls none of its
        # ops (every hook is onpolicy's), and GPU hosts whose torch it was not built for
        # cannot install it (docs/gpu-host.md).
        env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] = "1"
        # SGLang's Rust radix TreeCore is a compiled extension built against another torch: on
        # the GPU host's torch 2.11 it read the int64 KV indices as Int8 and the scheduler died
        # at the first insert (seen on the H200). The Python TreeCore is the same tree in Python.
        env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    return env if base is None else {**base, **env}


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
        # CUDA: decode batches replay captured graphs (SGLang's batch sizes); prefill is eager.
        "disable_cuda_graph": device != "cuda",
        "disable_prefill_cuda_graph": True,
        "page_size": 1,
        "disable_radix_cache": disable_radix_cache,
        # On CPU SGLang sizes the KV pool from the host's free memory, measured before and
        # after the weights load, less (1 - fraction) of it: at 0.99 memory a neighbour takes
        # meanwhile cannot fail the start, and the pool is max_total_tokens. On CUDA the share
        # must hold the weights (6.2 GB for configs/one-gpu.toml: 0.05 of an H100's 80 GB
        # did not) beside a trainer on the same GPU.
        "mem_fraction_static": 0.99 if device == "cpu" else 0.15,
        "max_total_tokens": 4096,
        "random_seed": 1234,
        "log_level": "error",
    }
    if chunked_prefill_size is not None:
        args["chunked_prefill_size"] = chunked_prefill_size
    if return_routed_experts:
        args["enable_return_routed_experts"] = True
    return args | extra


def engine_kwargs(model_path: str | os.PathLike, tp: int = 1, ep: int = 1,
                  dtype: str = "bfloat16", exact: bool = True,
                  **extra: Any) -> dict[str, Any]:  # fmt: skip
    """`sglang.Engine(**kwargs)` for one engine; `exact` routes every op to onpolicy.kernels,
    otherwise the same engine runs SGLang's stock path (the negative control: torch_native
    attention on CPU, triton on CUDA).
    `extra`: further `exact_engine_args` keywords."""
    kwargs = exact_engine_args(model_path, tp=tp, ep=ep, dtype=dtype, **extra)
    if not exact:
        del kwargs["rl_on_policy_target"]
        kwargs["attention_backend"] = "triton" if kwargs["device"] == "cuda" else "torch_native"
    return kwargs


def launch(model_path: str | os.PathLike, tp: int = 1, ep: int = 1, dtype: str = "bfloat16",
           exact: bool = True, *, warm_up: bool | None = None, **extra: Any):  # fmt: skip
    """A started `sglang.Engine` (see `engine_kwargs`; call `.shutdown()` when done).

    On CPU the process must already carry `engine_env(tp, run_dir)`: SGLang reads
    SGLANG_USE_CPU_ENGINE at import, so it cannot be set from here.
    `warm_up`: before returning, compile the prefill's Triton variants of an exact CUDA engine
    (`rollout.warmup`; one line on stderr says what it ran). None: on for an exact engine on
    CUDA (2588 prompts, 14630 tokens for a 4096-token extend batch at Qwen3-30B-A3B's heads),
    off otherwise (nothing compiles on CPU).
    """
    kwargs = engine_kwargs(model_path, tp, ep, dtype, exact, **extra)
    if kwargs["device"] == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        raise RuntimeError(
            "launch: SGLANG_USE_CPU_ENGINE is not 1 in this process; start it with "
            "onpolicy.rollout.engine_env(tp, run_dir) in its environment"
        )
    import sglang as sgl

    engine = sgl.Engine(**kwargs)
    if warm_up is None:
        warm_up = exact and kwargs["device"] == "cuda"
    if warm_up:
        from onpolicy.rollout.warmup import engine_prompts, warm_up_engine

        try:
            w = warm_up_engine(engine, engine_prompts(engine))
        except BaseException:  # the caller never gets the engine to shut it down
            engine.shutdown()
            raise
        print(f"onpolicy engine warm-up: {w.batches} batches, {w.prompts} prompts, {w.tokens} "
              f"tokens in {w.seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    return engine


def sglang_origin() -> str:
    """The file of the sglang package this process runs (which build, e.g. the patched one)."""
    import sglang

    return sglang.__file__


def sgl_kernel_installed() -> bool:
    """Whether SGLang's AOT CUDA kernels (sglang-kernel) import here: without them SGLang's stock
    CUDA path runs its torch ops (the H200 test host cannot install them)."""
    return importlib.util.find_spec("sgl_kernel") is not None


NATIVE_OPS_ENV = {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch"}
"""The environment of a stock engine that runs SGLang's native torch ops (and its Triton
attention): still not the exact path."""


def stock_runs_native_ops(device: str) -> bool:
    """Whether SGLang's stock engine on `device` must run its native torch ops (NATIVE_OPS_ENV):
    on CUDA without sglang-kernel its CUDA ops have no AOT kernels. The native MoE
    (moe_forward_native) reads its expert counts back to the host, which a graph capture
    refuses, so such an engine decodes eagerly."""
    return device == "cuda" and not sgl_kernel_installed()


# --- sampling -------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class RolloutRequest:
    """What one rollout samples: prompts, lengths, temperature, seeds."""

    prompts: list[list[int]]
    """Prompt token ids, one list per sample."""
    new_tokens: int
    """Tokens to generate per prompt (with `ignore_eos`, every sample has exactly this many)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    seed: int = 0
    """Base sampling seed; sample i uses seed + i (unless `seeds` is given)."""
    return_routed_experts: bool = False
    """Also return each sample's routed expert ids (the engine must have been started with
    return_routed_experts=True): field "routed_experts", `onpolicy.rollout.routing.encode` of
    int32 [len(prompt) + new_tokens - 1, layers, top_k]; `routing.decode` reads it."""
    seeds: list[int] | None = None
    """Per-sample sampling seeds, one per prompt, in place of seed + i."""
    ignore_eos: bool = True
    """Generate `new_tokens` past any EOS; False stops a sample at EOS (at least one token)."""
    stop_token_ids: list[int] | None = None
    """Ids that also end a sample (kept as its last token), unless `ignore_eos`."""


def sample(engine, req: RolloutRequest, *, shape: tuple[int, int] | None = None,
           tensors: bool = False, finish: bool = False) -> list[dict]:  # fmt: skip
    """Generate every prompt in one batch; per sample its prompt, output ids, fp32 log-probs
    (widened to Python floats, which is exact) and the weight version the engine reported.

    `finish`: also "finish", SGLang's finish reason ("length", "stop", ...). With
    `req.return_routed_experts` also "routed_experts" (see `RolloutRequest`), checked against
    `shape` (layers, top_k; default the engine's model), as int32 tensors with `tensors`.
    """
    n = len(req.prompts)
    if req.seeds is not None and len(req.seeds) != n:
        raise ValueError(f"sample: {len(req.seeds)} seeds for {n} prompts")
    seeds = req.seeds if req.seeds is not None else [req.seed + i for i in range(n)]
    stop = {"stop_token_ids": list(req.stop_token_ids)} if req.stop_token_ids else {}
    params = [
        {"temperature": req.temperature, "max_new_tokens": req.new_tokens,
         "ignore_eos": req.ignore_eos, "sampling_seed": seed, **stop}
        for seed in seeds
    ]  # fmt: skip
    extra = {"return_routed_experts": True} if req.return_routed_experts else {}
    outs = engine.generate(input_ids=req.prompts, sampling_params=params, return_logprob=True,
                           **extra)  # fmt: skip
    if req.return_routed_experts and shape is None:
        hf = engine.tokenizer_manager.model_config.hf_text_config
        shape = (hf.num_hidden_layers, hf.num_experts_per_tok)
    result = []
    for prompt, out in zip(req.prompts, outs, strict=True):
        meta = out["meta_info"]
        lps = meta["output_token_logprobs"]
        ids = [t for _lp, t, _txt in lps]
        short = len(ids) != req.new_tokens if req.ignore_eos else not ids
        if ids != out["output_ids"] or short:
            want = f"{req.new_tokens} of each" if req.ignore_eos else "at least one of each"
            raise RuntimeError(
                f"engine returned {len(out['output_ids'])} tokens with {len(ids)} log-probs for "
                f"prompt {prompt}; wanted {want}, for the same tokens"
            )
        s = {"prompt": prompt, "output_ids": ids, "logprobs": [lp for lp, _t, _x in lps],
             "weight_version": meta.get("weight_version")}  # fmt: skip
        if finish:
            s["finish"] = (meta.get("finish_reason") or {}).get("type")
        if req.return_routed_experts:
            s["routed_experts"] = _routes(meta, shape, tensors)
        result.append(s)
    return result


def _routes(meta: dict, shape: tuple[int, int], tensor: bool):
    """A response's routed expert ids, checked against (layers, top_k); JSON-safe unless
    `tensor`."""
    from onpolicy.rollout.routing import encode, routed_experts

    routes = routed_experts(meta, *shape)
    return routes if tensor else encode(routes)


# --- what the system asks of an engine ------------------------------------------------------
EngineOp = Literal[
    "info", "generate", "capture_generate", "begin_weight_update", "end_weight_update",
    "init_weights_update_group", "destroy_weights_update_group",
    "update_weights_from_distributed", "update_weights_from_tensor", "report_weights",
    "release_memory", "resume_memory", "shutdown",
]  # fmt: skip
"""The operations of `EngineHandle`, by the names `send` and `call` take."""


@runtime_checkable
class EngineHandle(Protocol):
    """One engine as the driver, the rollout actors and the weight sync see it.

    Every named op below can also be sent by name: `send(op, **kw)` starts it and returns at
    once, `result(timeout)` collects the oldest sent op's value (or raises its error), `call`
    is both. `WeightSync` sends an op to every engine, then runs its own side (joins the update
    group, broadcasts the bucket), then collects; an engine in this very process
    (`EngineService`) runs an op when it is sent.
    """

    name: str
    """A label for messages (e.g. "engine1")."""
    tp: int
    """The engine's TP size (its ranks in a weight-update group)."""
    ep: int
    """The engine's EP size."""

    # --- the transport
    def send(self, op: EngineOp, **kw: Any) -> None: ...
    def result(self, timeout: float = 900.0) -> Any: ...
    def call(self, op: EngineOp, timeout: float = 900.0, **kw: Any) -> Any: ...

    # --- sampling
    def info(self) -> dict:
        """tp, ep, pid and the weight version the engine serves."""
        ...

    def generate(self, request: dict | RolloutRequest, **options: Any) -> list[dict]:
        """`sample` of a `RolloutRequest` (or its dict); `options`: `sample`'s keywords."""
        ...

    def capture_generate(self, request: dict, out_dir: str) -> dict:
        """`generate` of one prompt with every TP rank's per-layer points captured
        (`onpolicy.rollout.capture`)."""
        ...

    # --- a weight-update session: begin, updates, end (SGLang's (success, message) replies)
    def begin_weight_update(self) -> Any: ...
    def end_weight_update(self) -> Any: ...
    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any: ...
    def destroy_weights_update_group(self, group_name: str) -> Any: ...
    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool,
        weight_version: str | None,
        **extra: Any,
    ) -> Any: ...
    def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: list[bytes],
        flush_cache: bool,
        weight_version: str | None,
        **extra: Any,
    ) -> Any: ...

    # --- the rest
    def report_weights(self) -> list[list[dict]]:
        """Every TP rank's `onpolicy.rollout.weights.report`, in rank order."""
        ...

    def release_memory(self) -> None:
        """Free the engine's GPU memory (weights and KV cache); `resume_memory` takes it back."""
        ...

    def resume_memory(self) -> None: ...
    def shutdown(self) -> None: ...


class RemoteOps:
    """`EngineHandle`'s named ops for a handle that reaches its engine through its own
    `call(op, **kw)` (a socket client, a Ray proxy)."""

    def call(self, op: EngineOp, timeout: float = 900.0, **kw: Any) -> Any:
        raise NotImplementedError

    def info(self) -> dict:
        return self.call("info")

    def generate(self, request: dict | RolloutRequest, **options: Any) -> list[dict]:
        return self.call("generate", request=request, **options)

    def capture_generate(self, request: dict, out_dir: str) -> dict:
        return self.call("capture_generate", request=request, out_dir=out_dir)

    def begin_weight_update(self) -> Any:
        return self.call("begin_weight_update")

    def end_weight_update(self) -> Any:
        return self.call("end_weight_update")

    def init_weights_update_group(self, **kw: Any) -> Any:
        return self.call("init_weights_update_group", **kw)

    def destroy_weights_update_group(self, group_name: str) -> Any:
        return self.call("destroy_weights_update_group", group_name=group_name)

    def update_weights_from_distributed(self, **kw: Any) -> Any:
        return self.call("update_weights_from_distributed", **kw)

    def update_weights_from_tensor(self, **kw: Any) -> Any:
        return self.call("update_weights_from_tensor", **kw)

    def report_weights(self) -> list[list[dict]]:
        return self.call("report_weights")

    def release_memory(self) -> None:
        return self.call("release_memory")

    def resume_memory(self) -> None:
        return self.call("resume_memory")

    def shutdown(self) -> None:
        return self.call("shutdown")


# --- SGLang's weight-update requests, both sides ---------------------------------------------
def update_weights_from_distributed(engine, **kw: Any):
    """The engine receives a broadcast bucket; `kw` are the fields of SGLang's request (the
    Engine method takes no weight_version, so the request goes to its tokenizer manager)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    return engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_distributed(
        UpdateWeightsFromDistributedReqInput(**kw), None))  # fmt: skip


def update_weights_from_tensor(engine, **kw: Any):
    """The engine loads shared-memory tensor handles (`tensor_payloads`), one payload per TP
    rank; `kw` are the fields of SGLang's request."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    return engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(**kw), None))  # fmt: skip


def join_update_group(*, backend: str, store, world_size: int, group_name: str,
                      timeout: timedelta):  # fmt: skip
    """The trainer's side (rank 0) of SGLang's weight-update group: the engines' ranks join
    `store` under the group name's prefix, as this does."""
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(
        backend=backend, store=dist.PrefixStore(group_name, store), world_size=world_size,
        rank=0, group_name=group_name, timeout=timeout,
    )  # fmt: skip


def tensor_payloads(named_tensors: list, tp: int) -> list[bytes]:
    """`update_weights_from_tensor`'s payloads for an engine of `tp` ranks: one serialization
    a rank (a CPU tensor's shared-memory handle can be taken once)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.serialize(named_tensors) for _ in range(tp)]
