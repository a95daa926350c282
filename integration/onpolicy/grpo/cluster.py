"""The run's Ray cluster: the head, one placement group, the actors in it, the calls to them, and
teardown.

`Cluster` starts (or joins) Ray, places one `TrainerActor` per trainer rank and one
`RolloutActor` per engine, and waits on their calls: a dead, failing or hung actor is a
`RunError` that names it (exit 3). Ray's token authentication is the run's
(`onpolicy.grpo.ray_auth`). Teardown stops every actor and the local head, then kills and names
any process of the run left (`onpolicy.grpo.procs`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from onpolicy.contract.errors import ContractError
from onpolicy.grpo import ray_auth
from onpolicy.grpo.config import E2EConfig
from onpolicy.grpo.procs import RUN_ID_ENV, reap, state
from onpolicy.rendezvous import LOOPBACK_HOSTS, loopback_env


class RunError(RuntimeError):
    """The run stopped: an actor died or hung, or a step broke the true-on-policy assertion."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Cluster:
    """Ray and the run's actors: started by `start`, called through `wait` / `all`."""

    def __init__(self, e: E2EConfig, *, run_id: str, authkey: str) -> None:
        self.e = e
        self.run_id = run_id
        self.authkey = authkey
        """The run's multiprocessing authkey (hex), shared by trainer rank 0 and the engines."""
        self.actors: list[tuple[str, Any]] = []
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.pg = None
        self.started_ray = False
        self._auth_env: dict[str, str | None] | None = None
        """The Ray auth variables `ray_auth.prepare` replaced, put back at teardown."""
        self.pids: dict[str, int] = {}
        """Each actor's process id, by name ("trainer rank 3", "engine0")."""
        self.times: dict[str, float] = {}
        self.warmup: dict | None = None
        """Trainer rank 0's compile warm-up (`TrainerActor.warm_up`), if it ran."""

    def start(self, ckpt: Path, resume_from: Path | None) -> list[dict]:
        """Ray up, every actor placed, started and set up; the engines' start reports."""
        t0 = time.perf_counter()
        self._ray_init()
        self.times["ray_init_s"] = time.perf_counter() - t0
        self._place(ckpt, resume_from)
        starts = [(f"engine{i}", a.start.remote()) for i, a in enumerate(self.engines)]
        # Rank 0 binds the trainers' store first and names its port (no free port picked here
        # and bound later, which another process could take in between).
        (port,) = self.wait([("trainer rank 0", self.trainers[0].open_rendezvous.remote())],
                            "start", self.e.run.start_timeout_s)  # fmt: skip
        setups = [(f"trainer rank {g}", a.setup.remote(port)) for g, a in enumerate(self.trainers)]
        values = self.wait(starts + setups, "start", self.e.run.start_timeout_s)
        self.times["trainer_setup_s"] = max(v["setup_s"] for v in values[len(self.engines) :])
        self.pids = {name: v["pid"] for (name, _), v in zip(starts + setups, values, strict=True)}
        return values[: len(self.engines)]

    def warm_up(self) -> dict | None:
        """The trainers' compile warm-up (`TrainerActor.warm_up`) where grpo.compile_warmup asks
        for it; trainer rank 0's report, or None. Only once the engines are up, never beside an
        engine's start: SGLang sizes its pool from the memory free as it starts. A colocated
        CUDA engine releases its memory around it, as around every step's update, and holds no
        weights after: the caller syncs them again."""
        e = self.e
        if e.grpo.compile_warmup == "never" or (e.grpo.compile_warmup == "cuda"
                                                and e.cfg.device != "cuda"):  # fmt: skip
            return None
        t0 = time.perf_counter()
        if self.releases_memory:
            self.all(self.engines, "engine", "release_memory")
        self.warmup = self.all(self.trainers, "trainer rank", "warm_up")[0]
        if self.releases_memory:
            self.all(self.engines, "engine", "resume_memory")
        self.times["warmup_s"] = time.perf_counter() - t0
        return self.warmup

    @property
    def releases_memory(self) -> bool:
        """Whether the engines give their GPU memory up while the trainers train (colocated on
        CUDA)."""
        c = self.e.cfg
        return c.device == "cuda" and c.rollout.colocate

    def _ray_init(self) -> None:
        r = self.e.run
        if not r.ray_address and self._loopback:
            # A local head on 127.0.0.1: Ray 2.60 replaces a loopback node address by the
            # host's own and its servers bind every interface, unless multi-node mode is off
            # (read when ray is first imported, so set before it).
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        try:  # the environment is checked here too: it may have changed since the config
            ray_auth.check_environment(r.ray_auth, r.ray_address)
            self._auth_env = ray_auth.prepare(r.ray_auth, r.ray_address, self.e.out_dir)
            if r.ray_address:
                ray.init(address=r.ray_address, log_to_driver=False, configure_logging=False)
                if r.ray_auth:
                    ray_auth.check_enforced(ray.get_runtime_context().gcs_address)
                return
        except ContractError as err:
            if ray.is_initialized():
                ray.shutdown()
            raise RunError(str(err), 2) from None
        n = self.bundles
        gpus = torch.cuda.device_count() if self.e.cfg.device == "cuda" else 0
        ray.init(num_cpus=n + 1, num_gpus=gpus, include_dashboard=False,
                 _node_ip_address=r.bind_address, log_to_driver=False,
                 configure_logging=False)  # fmt: skip
        self.started_ray = True

    @property
    def bundles(self) -> int:
        c = self.e.cfg
        world, rollout = c.training.world, c.rollout.engines * c.rollout.tp
        return world if c.rollout.colocate else world + rollout

    def _place(self, ckpt: Path, resume_from: Path | None) -> None:
        """One placement group: a bundle per trainer rank, then (unless colocated) a bundle per
        engine rank. A colocated engine i shares bundles i*tp .. i*tp + tp - 1 with the trainer."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from onpolicy.grpo.actors import EngineSpec, RolloutActor, TrainerActor, TrainerSpec

        c, e = self.e.cfg, self.e
        cuda = c.device == "cuda"
        unit = {"CPU": 1, "GPU": 1} if cuda else {"CPU": 1}
        self.pg = placement_group([dict(unit) for _ in range(self.bundles)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=e.run.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"start: the placement group of {self.bundles} bundles ({unit} each) "
                           f"was not ready within {e.run.start_timeout_s:.0f} s: the cluster "
                           "lacks the resources", 3) from None  # fmt: skip

        def at(bundle: int, share: float):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            )
            return {"scheduling_strategy": strategy, "num_cpus": share,
                    "num_gpus": share if cuda else 0}  # fmt: skip

        from onpolicy.contract import resolve_plan, stock_env
        from onpolicy.rollout import engine_env
        from onpolicy.rollout.engine import NATIVE_OPS_ENV, stock_runs_native_ops

        plan = resolve_plan(c)
        share = 0.5 if c.rollout.colocate else 1.0
        base = {RUN_ID_ENV: self.run_id} | loopback_env(e.run.bind_address)
        t = c.training
        host = e.run.bind_address
        spec = TrainerSpec(layout=t, dtype=c.model.dtype, device=c.device, ckpt=str(ckpt),
                           master_addr=host,
                           optimizer=e.optimizer, loss=e.loss, sync=e.sync,
                           temperature=e.grpo.temperature,
                           micro_batch_tokens=e.grpo.micro_batch_tokens,
                           resume=str(resume_from or ""), authkey=self.authkey)  # fmt: skip
        trainer_env = {**plan.training_env, **base, "OMP_NUM_THREADS": "1"}
        Trainer = ray.remote(TrainerActor)
        for g in range(t.world):
            a = Trainer.options(name=None, runtime_env={"env_vars": trainer_env},
                                **at(g, share)).remote(g, spec)  # fmt: skip
            self.trainers.append(a)
            self.actors.append((f"trainer rank {g}", a))
        Rollout = ray.remote(RolloutActor)
        r = c.rollout
        for i in range(r.engines):
            bundle = i * r.tp if r.colocate else t.world + i * r.tp
            exact = e.grpo.rollout_path == "exact"
            env = {**(plan.rollout_env if exact else stock_env(plan.rollout_env)), **base,
                   **engine_env(r.tp, e.cache_dir, c.device)}  # fmt: skip
            if cuda:  # the engine places its TP ranks on GPUs base_gpu_id.. itself
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            native = not exact and stock_runs_native_ops(c.device)  # and decodes eagerly
            if native:
                env |= NATIVE_OPS_ENV
            es = EngineSpec(index=i, ckpt=str(ckpt), tp=r.tp, ep=r.ep, dtype=c.model.dtype,
                            device=c.device, exact=exact,
                            routes=e.grpo.routing_check, num_layers=c.shape.num_hidden_layers,
                            top_k=c.shape.num_experts_per_tok,
                            base_gpu_id=bundle if cuda else 0, authkey=self.authkey,
                            mem_fraction=e.grpo.engine_mem_fraction,
                            memory_saver=cuda and r.colocate, eager=native,
                            warm_up=e.grpo.compile_warmup != "never")  # fmt: skip
            a = Rollout.options(runtime_env={"env_vars": env}, **at(bundle, share)).remote(es)
            self.engines.append(a)
            self.actors.append((f"engine{i}", a))

    @property
    def _loopback(self) -> bool:
        return self.e.run.bind_address in LOOPBACK_HOSTS

    def wait(self, calls: list[tuple[str, Any]], what: str,
             timeout: float | None = None) -> list[Any]:  # fmt: skip
        """Every call's value; RunError naming the first actor that died, failed or hung (no
        answer within `timeout`, run.actor_timeout_s by default)."""
        import ray

        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        timeout = self.e.run.actor_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                hung = ", ".join(self._describe(names[r]) for r in pending)
                raise RunError(f"{what}: no answer from {hung} within {timeout:.0f} s", 3)
            if _error(ready[0]) is not None:
                # A rank whose peer died fails in its collective at once, often before Ray has
                # noticed the death: wait briefly for the rest, and name a dead actor first.
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=10)
                errors = [(r, _error(r)) for r in ready + more]
                errors = [(r, e) for r, e in errors if e is not None]
                dead = [(r, e) for r, e in errors if isinstance(e, ray.exceptions.RayActorError)]
                ref, err = (dead or errors)[0]
                verb = "died" if dead else "failed"
                raise RunError(f"{what}: {names[ref]} {verb}: {_cause(err)}", 3)
        return ray.get([ref for _, ref in calls])

    def _describe(self, name: str) -> str:
        """An actor's name, with its process id and state once known ("trainer rank 1 (pid
        4242, stopped)"): which of the actors that did not answer is the stuck one."""
        pid = self.pids.get(name)
        return name if pid is None else f"{name} (pid {pid}, {state(pid)})"

    def all(self, actors: list[Any], label: str, method: str, *args, **kw) -> list[Any]:
        calls = [
            (
                f"{label} {i}" if label == "trainer rank" else f"engine{i}",
                getattr(a, method).remote(*args, **kw),
            )
            for i, a in enumerate(actors)
        ]
        return self.wait(calls, method)

    def teardown(self, graceful: bool = True) -> list[str]:
        """Stop every actor and the local Ray head; kill and name any process of the run left.
        `graceful` first asks each actor to shut down (not after a fault: a surviving rank
        would wait in a collective for the dead one)."""
        import ray

        t0 = time.perf_counter()
        if ray.is_initialized() and graceful:
            # Trainers first (rank 0 leaves the engines' weight-sync group), all ranks at once
            # (they leave their process groups together); then the engines.
            for group in (self.trainers, self.engines):
                refs = []
                for a in group:
                    try:
                        refs.append(a.shutdown.remote())
                    except Exception:  # a dead actor: killed below
                        pass
                try:
                    ray.wait(refs, num_returns=len(refs), timeout=60)
                except Exception:
                    pass
        if ray.is_initialized():
            for _, a in self.actors:
                try:
                    ray.kill(a)
                except Exception:
                    pass
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.pg)
                except Exception:
                    pass
            ray.shutdown()
        self.actors, self.trainers, self.engines = [], [], []
        if self._auth_env is not None:
            ray_auth.restore(self._auth_env)
            self._auth_env = None
        left = reap(self.run_id) if self.started_ray else []
        self.times["teardown_s"] = time.perf_counter() - t0
        return left


def _error(ref: Any) -> BaseException | None:
    """The exception a finished call raised, None when it returned."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayError as err:  # a dead actor, a failed method, a lost result
        return err
    return None


def _cause(err: BaseException) -> str:
    """One line: the root exception a failed actor call raised (type and message), not Ray's
    wrapper; for a dead actor, the first lines of Ray's report."""
    root = getattr(err, "cause", None)
    while isinstance(root, BaseException) and isinstance(getattr(root, "cause", None),
                                                           BaseException):  # fmt: skip
        root = root.cause  # a RayTaskError raised inside another actor call
    if isinstance(root, BaseException) and not type(root).__module__.startswith("ray."):
        while root.__cause__ is not None:  # `raise X from Y`: Y is where it started
            root = root.__cause__
        message = " ".join(str(root).split())
        return f"{type(root).__name__}: {message}"[:800]
    text = str(err).strip().splitlines()
    keep = [ln for ln in text if ln.strip()][:6]
    return " | ".join(keep)[:800]


def memory_saver_problem(cfg) -> str:
    """Why this Python cannot release a colocated CUDA engine's memory while the trainer trains
    ("" when it can, or when nothing is colocated on CUDA): SGLang frees the weights and KV
    cache through torch-memory-saver, which the engine's process imports."""
    import importlib.util

    if cfg.device != "cuda" or not cfg.rollout.colocate:
        return ""
    if importlib.util.find_spec("torch_memory_saver") is not None:
        return ""
    return ("[memory_saver] rollout.colocate = true on CUDA: the engine releases its weights and "
            "KV cache while the trainer trains, through torch-memory-saver, which this Python "
            "cannot import; install it (`pip install torch-memory-saver==0.0.10`, or on an "
            "offline GPU host `python -m onpolicy.upstream.gpu_lean install-loop`, "
            "docs/gpu-host.md)")  # fmt: skip
