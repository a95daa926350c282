"""The one trainer builder: join the world at a layout, seed, build this rank's model, load it.

Every Megatron trainer (the GRPO trainer actor, `onpolicy convert`, the benchmarks, the parity
trainer, the engine tests) starts the same way:

    layout = ParallelLayout.from_args(args)    # or the run config's [training], passed whole
    init_parallel(layout)                      # torch.distributed, then megatron-core's groups
    set_seed()                                 # megatron-core's RNG tracker, seed SEED
    cfg, model = load_model(ckpt, layout, dtype, spec="exact")   # this rank's shards loaded

The steps stay separate calls because the seed's place differs between trainers (once before
several models, or before each), and the RNG state it leaves is part of their bits.
`load_model` reads the HF checkpoint and maps it to this rank (`hf_to_megatron`); a trainer
that builds several models from one read (the policy and its frozen reference) reads once and
passes `weights` to `build_model` itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.hf_megatron import hf_to_megatron
from onpolicy.train.megatron_model import build_gpt_model, initialize_parallel_state

SEED = 1234
"""megatron-core's model-parallel seed of the trainers (the parameters' initial values, before
the loaded weights replace them)."""


def init_parallel(
    layout: ParallelLayout,
    *,
    device: str = "cpu",
    store: dist.Store | None = None,
    rank: int | None = None,
) -> None:
    """Join the trainer's torch.distributed world and set megatron-core's groups from `layout`
    (`initialize_parallel_state`, which checks every rank sits where the layout says).

    `device`: 'cpu' (gloo) or 'cuda' (NCCL, on the GPU LOCAL_RANK names). Without `store`, the
    rank and world come from torchrun's environment; with one (`onpolicy.rendezvous.tcp_store`),
    pass this process's `rank`.
    """
    if device == "cuda":
        deterministic_cuda()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device == "cuda" else "gloo"
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world)
    if dist.get_world_size() != layout.world:
        raise RuntimeError(f"{dist.get_world_size()} ranks joined; the layout {layout.name()} "
                           f"needs {layout.world}")  # fmt: skip
    initialize_parallel_state(layout)


CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's fixed workspace configuration, which its reproducible results need."""


def deterministic_cuda() -> None:
    """Make this process's CUDA training repeat bit for bit, so a resumed run continues the
    uninterrupted one: the exact ops fix the forward, but the backward's native ops accumulate
    through atomics (index_add, scatter_add), whose order varies between runs (on an H100 an
    fp32 index_add of 65536 rows into 64 gave 20 results in 20 runs). torch's deterministic
    implementations replace them; an op that has none warns, naming itself, rather than
    failing the run. Call before the first cuBLAS handle (before any matmul)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every new tensor; nothing here reads memory it did not
    # write, so that costs bandwidth for nothing.
    torch.utils.deterministic.fill_uninitialized_memory = False


def set_seed(seed: int = SEED) -> None:
    """Seed megatron-core's RNG tracker (`model_parallel_cuda_manual_seed`; on CPU it also seeds
    torch's default generator). Call it after `init_parallel`, before building."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)


def build_model(
    cfg: Qwen3MoeConfig,
    layout: ParallelLayout,
    dtype: torch.dtype = torch.float32,
    *,
    spec: str = "exact",
    weights: Mapping[str, torch.Tensor] | None = None,
    device: str = "cpu",
) -> torch.nn.Module:
    """This rank's GPTModel at `layout` with the `spec` ('exact' or megatron-core's 'local'),
    `weights` (this rank's Megatron state dict, e.g. from `hf_to_megatron`) loaded strictly,
    on `device` ('cpu' or 'cuda'). Without `weights` the parameters keep their seeded init."""
    model = build_gpt_model(cfg, layout, dtype, spec=spec)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model.cuda() if device == "cuda" else model


def load_model(
    ckpt: str | os.PathLike, layout: ParallelLayout, dtype: torch.dtype = torch.float32, *,
    spec: str = "exact", device: str = "cpu",
) -> tuple[Qwen3MoeConfig, torch.nn.Module]:  # fmt: skip
    """The model shape and this rank's GPTModel at `layout`, loaded from the HF checkpoint
    `ckpt` (read leniently: the safetensors and their names; the shape from its config)."""
    cfg = Qwen3MoeConfig.from_hf(ckpt)
    hf = read_hf_checkpoint(ckpt, strict=False).tensors
    weights = hf_to_megatron(cfg, hf, layout, dist.get_rank(), dtype)
    del hf
    return cfg, build_model(cfg, layout, dtype, spec=spec, weights=weights, device=device)
