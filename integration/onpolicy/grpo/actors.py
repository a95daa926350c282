"""The run's Ray actors: one `RolloutActor` per SGLang engine, one `TrainerActor` per Megatron rank.

Both are plain classes; the driver wraps them with `ray.remote` and places them. Every method
runs on the actor's main thread, one at a time: SGLang's Engine is made and used on one thread
(its event loop), and torch.distributed's collectives are entered in the same order on every
trainer rank because the driver calls each method on all ranks at once.

A rollout actor holds an `EngineService` (the engine in the actor's own process; the engine's
TP x EP scheduler processes are its children, and `Engine.shutdown` or the actor's death takes
them down). The trainer actors form one torch.distributed world (gloo on CPU, NCCL on GPU)
with megatron-core's groups for the layout; rank 0 also talks to the engines for the weight
sync, through `EngineProxy`: a rollout actor as an `onpolicy.rollout.engine.EngineHandle`
(the send/result transport and the named ops) over Ray calls.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onpolicy.layout import ParallelLayout
from onpolicy.rollout.engine import EngineOp, RemoteOps


# --- the rollout side -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """What a rollout actor starts."""

    index: int
    """Engine number (0-based); names it in messages."""
    ckpt: str
    """HF checkpoint folder the engine loads."""
    tp: int
    """SGLang tp_size."""
    ep: int
    """SGLang ep_size."""
    dtype: str
    """Model dtype."""
    device: str
    """'cpu' or 'cuda'."""
    exact: bool = True
    """The onpolicy exact path; False runs SGLang's stock CPU path (the negative control)."""
    routes: bool = True
    """Return each sample's routed expert ids."""
    num_layers: int = 0
    """Decoder layers (the routes' second dim)."""
    top_k: int = 0
    """Experts per token (the routes' third dim)."""
    base_gpu_id: int = 0
    """First GPU of the engine on its node (CUDA)."""
    authkey: str = ""
    """The run's multiprocessing authkey (hex), shared with trainer rank 0: the colocated
    "tensor" transport's file-descriptor handles are fetched with it."""
    mem_fraction: float = 0.5
    """SGLang's mem_fraction_static (`GRPOConfig.engine_mem_fraction`)."""
    eager: bool = False
    """Decode without CUDA graphs (the stock control on SGLang's native torch ops)."""
    memory_saver: bool = False
    """SGLang's enable_memory_saver (colocated on CUDA): `release_memory` then frees the weights
    and KV cache through torch-memory-saver; without it the release keeps them resident."""
    warm_up: bool = True
    """Let the engine compile its prefill variants as it starts where `launch` does by default
    (an exact engine on CUDA, `rollout.warmup`); False (grpo.compile_warmup = "never"): not."""


def preload_finds_cudart() -> None:
    """Let the dynamic loader find the CUDA runtime that torch loaded: SGLang starts its
    scheduler with torch-memory-saver's hook library in LD_PRELOAD, which needs libcudart, and
    a pip-installed torch keeps libcudart in its own `nvidia/.../lib` folder, on no loader path.
    A preload the loader cannot resolve is dropped with only a warning, and then nothing is
    released."""
    torch.cuda.init()
    maps = Path("/proc/self/maps").read_text().split()
    dirs = sorted({str(Path(w).parent) for w in maps if Path(w).name.startswith("libcudart.so")})
    have = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    os.environ["LD_LIBRARY_PATH"] = ":".join(dirs + [d for d in have if d not in dirs])


class RolloutActor:
    """One SGLang engine inside a Ray actor."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.name = f"engine{spec.index}"
        self.service = None

    def start(self) -> dict:
        """Start the engine; its info (tp, ep, pid, weight version)."""
        from onpolicy.rollout.host import EngineService

        s = self.spec
        if s.authkey:  # the engine's scheduler processes inherit it
            multiprocessing.current_process().authkey = bytes.fromhex(s.authkey)
        # sleep_on_idle: an idle scheduler waits on its sockets instead of spinning, which on
        # CPU would take cores from the trainer while it trains and syncs.
        extra: dict[str, Any] = {"device": s.device, "sleep_on_idle": True}
        if s.device == "cuda":  # on CPU the pool is sized in tokens (exact_engine_args)
            extra["mem_fraction_static"] = s.mem_fraction
        if s.routes:
            extra["return_routed_experts"] = True
        if s.device == "cuda":
            extra["base_gpu_id"] = s.base_gpu_id
        if s.eager:
            extra["disable_cuda_graph"] = True
        if s.memory_saver:
            extra["enable_memory_saver"] = True
            preload_finds_cudart()
        self.service = EngineService(s.ckpt, tp=s.tp, ep=s.ep, dtype=s.dtype, exact=s.exact,
                                     name=self.name, warm_up=None if s.warm_up else False,
                                     **extra)  # fmt: skip
        return self.service.info() | {"name": self.name}

    def call(self, op: str, kw: dict) -> Any:
        """One `EngineService` operation by name (what `EngineProxy` sends)."""
        return getattr(self.service, op)(**kw)

    def generate(self, prompts: list[list[int]], seeds: list[int], *, temperature: float,
                 max_new_tokens: int, ignore_eos: bool,
                 stop_token_ids: list[int] | None = None) -> list[dict]:  # fmt: skip
        """Sample every prompt once, sample i with `seeds[i]`: output ids, fp32 log-probs (as
        Python floats, which is exact), the weight version, the finish reason and (with
        `spec.routes`) routed expert ids, int32 [len(prompt) + len(output) - 1, layers, top_k].
        A sample ends at max_new_tokens, or (unless `ignore_eos`) at the model's EOS or one of
        `stop_token_ids`."""
        from onpolicy.rollout.engine import RolloutRequest

        s = self.spec
        req = RolloutRequest(prompts=prompts, new_tokens=max_new_tokens, temperature=temperature,
                             seeds=list(seeds), ignore_eos=ignore_eos,
                             stop_token_ids=stop_token_ids,
                             return_routed_experts=s.routes)  # fmt: skip
        samples = self.service.generate(req, shape=(s.num_layers, s.top_k), tensors=True,
                                        finish=True)  # fmt: skip
        return [{k: v for k, v in x.items() if k != "prompt"} for x in samples]

    def release_memory(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the colocated trainer
        trains; `resume_memory` takes it back before the weight sync."""
        self.service.release_memory()

    def resume_memory(self) -> None:
        self.service.resume_memory()

    def memory_usage(self) -> dict:
        """`EngineService.memory_usage`: weight, kvcache and graph GB."""
        return self.service.memory_usage()

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.shutdown()
            self.service = None


class EngineProxy(RemoteOps):
    """A rollout actor as an `EngineHandle` (what `WeightSync` is given): `send` now, `result`
    later, `call`, and the named ops as calls."""

    def __init__(self, name: str, tp: int, ep: int, handle: Any) -> None:
        self.name, self.tp, self.ep, self.handle = name, tp, ep, handle
        self.pending: list[tuple[str, Any]] = []

    def send(self, op: EngineOp, **kw) -> None:
        self.pending.append((op, self.handle.call.remote(op, kw)))

    def result(self, timeout: float = 900.0) -> Any:
        import ray

        op, ref = self.pending.pop(0)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{self.name}: no reply to {op} within {timeout:.0f} s") from None

    def call(self, op: EngineOp, timeout: float = 900.0, **kw) -> Any:
        self.send(op, **kw)
        return self.result(timeout)

    def shutdown(self) -> None:
        """The actor's own shutdown (it drops its service), not the service's op."""
        import ray

        ray.get(self.handle.shutdown.remote(), timeout=900.0)


# --- the trainer side -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    """What every trainer rank builds."""

    layout: ParallelLayout
    """The trainer's layout (the run config's [training], passed whole)."""
    dtype: str
    """Parameter dtype."""
    device: str
    """'cpu' (gloo) or 'cuda' (NCCL)."""
    ckpt: str
    """HF checkpoint the model starts from."""
    master_addr: str
    """Address of the rendezvous (rank 0 binds it on a port of the OS's pick)."""
    optimizer: Any
    """`onpolicy.train.step.OptimizerSettings`."""
    loss: Any
    """`onpolicy.train.loss.PPOClipConfig`."""
    sync: Any
    """`onpolicy.weights.SyncConfig`."""
    temperature: float
    """Scoring temperature (the sampling one)."""
    micro_batch_tokens: int
    """Token budget of one packed micro-batch."""
    resume: str = ""
    """A torch-dist checkpoint (root or iteration) to load model and optimizer from."""
    authkey: str = ""
    """The run's multiprocessing authkey (hex), shared with the engines (see EngineSpec)."""


class TrainerActor:
    """One Megatron rank: the exact-spec policy, its optimizer, and (rank 0) the weight sync."""

    def __init__(self, rank: int, spec: TrainerSpec) -> None:
        self.rank, self.spec = rank, spec
        self.sync = None
        self._store = None

    def open_rendezvous(self) -> int:
        """Rank 0: bind the process group's store on master_addr, port 0 (the OS's pick), and
        return the port the other ranks join. Bound here and kept, never picked free and bound
        later: another process could take a port in between."""
        from onpolicy.rendezvous import tcp_store

        s = self.spec
        self._store = tcp_store(s.master_addr, 0, s.layout.world, is_master=True)
        return self._store.port

    def setup(self, master_port: int) -> dict:
        """Join the process group (rank 0 through the store `open_rendezvous` bound, the others
        at `master_port`), build the model at the layout, load it, wrap it for training."""
        from onpolicy.checkpoint import torch_dist
        from onpolicy.models.hf_layout import read_hf_checkpoint
        from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
        from onpolicy.rendezvous import tcp_store
        from onpolicy.train.builder import build_model, init_parallel, set_seed
        from onpolicy.train.hf_megatron import hf_to_megatron
        from onpolicy.train.step import setup_training

        s = self.spec
        t0 = time.perf_counter()
        if s.authkey:
            multiprocessing.current_process().authkey = bytes.fromhex(s.authkey)
        self.layout = s.layout
        if self.rank == 0:
            if self._store is None:
                raise RuntimeError("trainer rank 0: setup before open_rendezvous")
            store = self._store
        else:
            store = tcp_store(s.master_addr, master_port, s.layout.world, is_master=False)
        init_parallel(s.layout, device=s.device, store=store, rank=self.rank)
        set_seed()
        self.cfg = Qwen3MoeConfig.from_hf(s.ckpt)
        self.dtype = getattr(torch, s.dtype)
        hf = read_hf_checkpoint(s.ckpt, strict=False).tensors

        def built():
            weights = hf_to_megatron(self.cfg, hf, self.layout, self.rank, self.dtype)
            return build_model(self.cfg, self.layout, self.dtype, spec="exact", weights=weights,
                               device=s.device)  # fmt: skip

        self.chunks, self.optimizer = setup_training(built(), s.optimizer)
        self.ref = None
        if s.loss.kl_coef > 0:  # the frozen starting policy, for the KL term
            self.ref = built().eval()
        hf = None  # the rank's shards are loaded; free the full state dict
        self.iteration = 0
        if s.resume:
            manifest = torch_dist.load(s.resume, self.chunks, optimizer=self.optimizer,
                                       cfg=self.cfg, layout=self.layout)  # fmt: skip
            self.iteration = int(manifest["iteration"])
        return {"rank": self.rank, "pid": os.getpid(), "iteration": self.iteration,
                "setup_s": time.perf_counter() - t0}  # fmt: skip

    def warm_up(self) -> dict:
        """Score the warm-up batches (sequences of token 0, up to one micro-batch; the log-probs
        are dropped), then run the update's forward and backward on each (no optimizer step;
        the gradients are zeroed after), so the Triton variants of both forwards compile now:
        with gradients the GEMM keeps fp32 partials, so the update's variants are not the
        scoring ones. Every rank takes part, as in `score` and `train`. The counts around each
        bound are also scaled by TP, since with sequence parallelism part of a layer sees
        T / TP rows."""
        from dataclasses import asdict

        from onpolicy.kernels.cuda.warmup import warm_up, warmup_batches
        from onpolicy.train.logprobs import logprobs
        from onpolicy.train.step import forward_backward

        c, tp = self.cfg, self.layout.tp
        g = c.num_attention_heads // c.num_key_value_heads
        batches = warmup_batches(self.spec.micro_batch_tokens, c.num_experts_per_tok, g,
                                 max(c.num_key_value_heads // tp, 1), min_len=2,
                                 scales=(1, tp), fp32=self.dtype == torch.float32)  # fmt: skip
        modes = [chunk.training for chunk in self.chunks]
        cuda = self.spec.device == "cuda"

        def forward(lengths: list[int]) -> None:
            seqs = [[0] * n for n in lengths]
            logprobs(self.chunks, seqs, self.spec.temperature,
                     micro_batch_tokens=self.spec.micro_batch_tokens)  # fmt: skip
            batch = {"sequences": seqs, "response_starts": [1] * len(seqs),
                     "rollout_logprobs": [[0.0] * (n - 1) for n in lengths],
                     "advantages": [0.0] * len(seqs)}  # fmt: skip
            for chunk in self.chunks:
                chunk.train()
            forward_backward(self.chunks, self._micro_batches(batch), loss=self.spec.loss,
                             temperature=self.spec.temperature)  # fmt: skip
            if cuda:
                torch.cuda.synchronize()

        stats = warm_up(forward, batches)
        self.optimizer.zero_grad()
        for chunk, mode in zip(self.chunks, modes, strict=True):
            chunk.zero_grad_buffer()
            chunk.train(mode)
        self._settle()
        if cuda:
            torch.cuda.empty_cache()  # the warm-up's blocks, back for a colocated engine
        return asdict(stats)

    # --- collective helpers ---------------------------------------------------------------------
    def _settle(self) -> None:
        """Every rank syncs across its TP, PP and EP groups before rank 0 alone reports, so no
        collective of the step is still in flight on any group when the driver moves on."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        for group in (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                      ps.get_expert_model_parallel_group()):  # fmt: skip
            dist.barrier(group=group)

    # --- one step -------------------------------------------------------------------------------
    def score(self, sequences: list[list[int]], routes: bool) -> dict | None:
        """The policy's fp32 log-probs of every sequence (tokens 1..n-1) and, with `routes`,
        its routed expert ids [n, layers, k], as numpy arrays; on rank 0, None elsewhere.

        Numpy, not torch: megatron.core replaces torch's `storage._load_from_bytes` with its
        own, so a tensor pickled in this process names megatron.core, and unpickling it
        imported all of megatron.core into the driver at step 1's score (3 s on CPU)."""
        from onpolicy.train.logprobs import logprobs

        t0 = time.perf_counter()
        kw = {"routes": True} if routes else {}
        with self._compiles("score") as compiles:
            out = logprobs(self.chunks, sequences, self.spec.temperature,
                           micro_batch_tokens=self.spec.micro_batch_tokens, **kw)  # fmt: skip
        self._settle()
        if self.rank != 0:
            return None
        values, found = out if routes else (out, None)
        return {"logprobs": [v.numpy() for v in values],
                "routes": None if found is None else [r.numpy() for r in found],
                "seconds": time.perf_counter() - t0,
                "compiles": compiles[0] if compiles else None}  # fmt: skip

    @contextlib.contextmanager
    def _compiles(self, label: str) -> Iterator[list[int]]:
        """On CUDA, yields a list that holds, after the block, the Triton kernels this rank
        compiled or loaded from the disk cache inside it (empty on CPU)."""
        out: list[int] = []
        if self.spec.device != "cuda":
            yield out
            return
        from onpolicy.kernels.cuda.warmup import CompileLog

        log = CompileLog()
        with log.counting(label):
            yield out
        _, compiles, hits = log.total()
        out.append(compiles + hits)

    def train(self, batch: dict) -> dict | None:
        """One PPO-clip step on the global batch (the same on every rank): sequences, the
        rollout's log-probs (the sampling policy), per-sample advantages, response starts."""
        from onpolicy.train.step import train_step

        t0 = time.perf_counter()
        with self._compiles("train") as compiles:
            result = train_step(self.chunks, self.optimizer, self._micro_batches(batch),
                                loss=self.spec.loss, temperature=self.spec.temperature)  # fmt: skip
        self.iteration += 1
        self._settle()
        if self.spec.device == "cuda":
            # Hand the step's cached activation blocks back to the driver: a colocated engine
            # takes its weights and KV cache back next, on the same GPU.
            torch.cuda.empty_cache()
        if self.rank != 0:
            return None
        return {"loss": result.loss, "grad_norm": result.grad_norm,
                "num_tokens": result.num_tokens, **result.metrics,
                "seconds": time.perf_counter() - t0,
                "compiles": compiles[0] if compiles else None}  # fmt: skip

    def _micro_batches(self, batch: dict) -> list:
        """This rank's packed micro-batches of `batch` (see `train`): per predicted token the
        rollout's log-prob and the advantage on the response, masked off on the prompt, and
        the frozen policy's log-probs when the loss has a KL term."""
        import torch.distributed as dist

        from onpolicy.train.logprobs import logprobs
        from onpolicy.train.step import policy_micro_batches

        seqs, starts = batch["sequences"], batch["response_starts"]
        old, adv, mask = [], [], []
        for seq, start, lps, a in zip(seqs, starts, batch["rollout_logprobs"],
                                      batch["advantages"], strict=True):  # fmt: skip
            n = len(seq) - 1  # predicted tokens; token i is predicted at i - 1
            o = torch.zeros(n, dtype=torch.float32)
            o[start - 1 :] = torch.tensor(lps, dtype=torch.float32)
            m = torch.zeros(n, dtype=torch.float32)
            m[start - 1 :] = 1.0
            old.append(o)
            mask.append(m)
            adv.append(m * a)
        ref = None
        if self.ref is not None:
            box = [logprobs(self.ref, seqs, self.spec.temperature,
                            micro_batch_tokens=self.spec.micro_batch_tokens)]  # fmt: skip
            dist.broadcast_object_list(box, src=0)
            ref = box[0]
        return policy_micro_batches(seqs, old, adv, mask, ref_logprobs=ref,
                                    micro_batch_tokens=self.spec.micro_batch_tokens)  # fmt: skip

    def capture(self, sequence: list[int], out_dir: str) -> None:
        """Score one sequence with every rank's per-layer points captured into `out_dir`
        (`onpolicy.train.capture`, for `--bisect`)."""
        from onpolicy.train.capture import capture_logprobs

        capture_logprobs(self.chunks, sequence, self.spec.temperature, out_dir)
        self._settle()

    # --- weights --------------------------------------------------------------------------------
    def connect(self, engines: list[dict]) -> None:
        """Set up the weight sync; `engines` (used on rank 0): name, tp, ep, actor handle."""
        from onpolicy.weights import Gatherer, WeightSync

        proxies = [EngineProxy(e["name"], e["tp"], e["ep"], e["handle"]) for e in engines]
        gatherer = Gatherer(self.chunks[0], self.cfg, self.layout)
        self.sync = WeightSync(gatherer, proxies if self.rank == 0 else [], self.spec.sync)

    def sync_weights(self, version: str, verify: bool) -> dict | None:
        """Send the policy to every engine as `version`; with `verify`, check every engine
        rank's weights by digest. Stats on rank 0."""
        t0 = time.perf_counter()
        stats = self.sync.sync(version)
        t1 = time.perf_counter()
        checked = self.sync.verify() if verify else None
        self._settle()
        if self.rank != 0:
            return None
        return {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets,
                "verified_boxes": checked.boxes if checked else 0,
                "weights_sha256": checked.sha256 if checked else "",
                "verify_seconds": time.perf_counter() - t1 if checked else 0.0,
                "seconds": time.perf_counter() - t0}  # fmt: skip

    def save(self, root: str, iteration: int) -> str:
        """Save model and optimizer as `iteration` of `root` (atomic; every rank)."""
        from onpolicy.checkpoint import torch_dist

        path = torch_dist.save(root, self.chunks, optimizer=self.optimizer, iteration=iteration,
                               cfg=self.cfg, layout=self.layout, dtype=self.dtype,
                               source_hf=self.spec.ckpt)  # fmt: skip
        return str(path)

    def params_digest(self) -> str | None:
        """SHA-256 of every parameter of every rank, in rank order (rank 0; for tests)."""
        import hashlib

        import torch.distributed as dist

        h = hashlib.sha256()
        for chunk in self.chunks:
            for name, p in sorted(chunk.named_parameters()):
                h.update(name.encode() + p.detach().cpu().contiguous().view(torch.uint8)
                         .numpy().tobytes())  # fmt: skip
        digests = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(h.hexdigest(), digests, dst=0)
        if self.rank != 0:
            return None
        return hashlib.sha256("".join(digests).encode()).hexdigest()

    def shutdown(self) -> None:
        """Leave the weight-sync group and the process groups."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.sync is not None:
            self.sync.close()
            self.sync = None
        if dist.is_initialized():
            dist.barrier()
            ps.destroy_model_parallel()
            dist.destroy_process_group()
