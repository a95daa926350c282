"""The GRPO driver: Ray placement, the step loop, the true-on-policy assertion, teardown.

One step (`Driver.step`):
1. every engine samples its share of the step's prompts x n, with log-probs, at temperature T;
2. the task's rule rewards every sample;
3. group-normalised advantages;
4. the trainer scores the same sequences (and reports its routed expert ids); the driver
   compares each generated token's two fp32 log-probs as bits and computes the metrics; in
   true-on-policy mode any difference stops the run here, naming the first differing token;
5. one PPO-clip update on the rollout's log-probs as the sampling policy;
6. the weights go to every engine as version step (checked by digest when configured).
Only the driver writes metrics (`MetricsLogger`: JSONL, wandb, a console line, a progress bar).

Faults: a dead or hung actor stops the run with its name and cause; Ctrl-C stops it; either
way every actor is torn down, the local Ray head stopped, and any process of the run left
behind is killed and named (`RunError` then says so).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onpolicy.bits import as_bits
from onpolicy.grpo.advantages import group_advantages
from onpolicy.grpo.config import E2EConfig
from onpolicy.parity import Mismatch, checkpoint, compare

RUN_ID_ENV = "ONPOLICY_RUN_ID"
"""Set in the driver and inherited by every process of the run (Ray's head and workers, the
engines' schedulers): how teardown finds what is left of the run."""


class RunError(RuntimeError):
    """The run stopped: an actor died or hung, or a step broke the true-on-policy assertion."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class OnPolicyViolation(RunError):
    """A step's trainer log-probs differ from the rollout's."""

    def __init__(self, message: str, mismatch: Mismatch | None) -> None:
        super().__init__(message, 1)
        self.mismatch = mismatch


# --- metrics of one step ------------------------------------------------------------------------
def logprob_metrics(samples: list[dict], scores: list[torch.Tensor]) -> dict[str, float]:
    """The rollout's log-probs against the trainer's, over every generated token.

    abs_diff = mean |train - rollout|; kl = mean (r - 1 - log r) with r = p_train / p_rollout,
    the k3 estimate of KL(rollout || train) on the rollout's own samples; both in float64, so
    they are 0.0 exactly when every pair is equal. equal_frac counts equal bits."""
    diffs, equal, total = [], 0, 0
    for s, lp in zip(samples, scores, strict=True):
        got = torch.tensor(s["logprobs"], dtype=torch.float32)
        want = lp[len(s["prompt"]) - 1 :]
        equal += int((as_bits(got) == as_bits(want)).sum())
        total += len(got)
        diffs.append(want.double() - got.double())
    d = torch.cat(diffs)
    kl = torch.expm1(d) - d
    return {"train/train_rollout_logprob_abs_diff": float(d.abs().mean()),
            "train/train_rollout_kl": float(kl.mean()),
            "train/logprob_equal_frac": equal / total,
            "train/logprob_max_abs_diff": float(d.abs().max()),
            "train/tokens_compared": total}  # fmt: skip


@dataclass
class StepRecord:
    """What one step produced (the driver's view)."""

    step: int
    metrics: dict[str, Any]
    samples: list[dict] = field(default_factory=list)


# --- the driver -------------------------------------------------------------------------------
class Driver:
    """Owns Ray, the actors and the loop of one run."""

    def __init__(self, e: E2EConfig, *, resume: bool = False, log=print) -> None:
        self.e, self.log = e, log
        self.out = e.out_dir
        self.resume = resume
        self.actors: list[tuple[str, Any]] = []
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.engine_info: list[dict] = []
        self.pg = None
        self.started_ray = False
        self.run_id = os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex
        self.authkey = secrets.token_hex(16)
        os.environ[RUN_ID_ENV] = self.run_id
        self.start_step = 0
        self.times: dict[str, float] = {}

    # --- setup ----------------------------------------------------------------------------------
    def _ray_init(self) -> None:
        r = self.e.run
        if not r.ray_address and self._loopback:
            # A local head on 127.0.0.1: Ray 2.60 replaces a loopback node address by the
            # host's own and its servers bind every interface, unless multi-node mode is off
            # (read when ray is first imported, so set before it).
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        if r.ray_address:
            ray.init(address=r.ray_address, log_to_driver=False, configure_logging=False)
            return
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

    def _place(self) -> None:
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
        ray.get(self.pg.ready(), timeout=e.run.actor_timeout_s)

        def at(bundle: int, share: float):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            )
            return {"scheduling_strategy": strategy, "num_cpus": share,
                    "num_gpus": share if cuda else 0}  # fmt: skip

        from onpolicy.contract import resolve_plan
        from onpolicy.rollout import engine_env

        plan = resolve_plan(c)
        share = 0.5 if c.rollout.colocate else 1.0
        # gloo binds the address its host name resolves to unless told the interface.
        base = {RUN_ID_ENV: self.run_id} | ({"GLOO_SOCKET_IFNAME": "lo"} if self._loopback else {})
        t = c.training
        host = e.run.bind_address
        spec = TrainerSpec(world=t.world, tp=t.tp, pp=t.pp, ep=t.ep, etp=t.etp, sp=t.sp,
                           dtype=c.model.dtype, device=c.device, ckpt=str(self.ckpt),
                           master_addr=host, master_port=_free_port(host),
                           optimizer=e.optimizer, loss=e.loss, sync=e.sync,
                           temperature=e.grpo.temperature,
                           micro_batch_tokens=e.grpo.micro_batch_tokens,
                           resume=str(self.resume_from or ""), authkey=self.authkey)  # fmt: skip
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
            env = {**plan.rollout_env, **base,
                   **engine_env(r.tp, e.cache_dir, c.device)}  # fmt: skip
            if cuda:  # the engine places its TP ranks on GPUs base_gpu_id.. itself
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            es = EngineSpec(index=i, ckpt=str(self.ckpt), tp=r.tp, ep=r.ep, dtype=c.model.dtype,
                            device=c.device, exact=e.grpo.rollout_path == "exact",
                            routes=e.grpo.routing_check, num_layers=c.shape.num_hidden_layers,
                            top_k=c.shape.num_experts_per_tok,
                            base_gpu_id=bundle if cuda else 0, authkey=self.authkey,
                            mem_fraction=e.grpo.engine_mem_fraction)  # fmt: skip
            a = Rollout.options(runtime_env={"env_vars": env}, **at(bundle, share)).remote(es)
            self.engines.append(a)
            self.actors.append((f"engine{i}", a))

    @property
    def _loopback(self) -> bool:
        return self.e.run.bind_address in ("127.0.0.1", "localhost")

    def _wait(self, calls: list[tuple[str, Any]], what: str) -> list[Any]:
        """Every call's value; RunError naming the first actor that died, failed or hung."""
        import ray

        names = {ref: name for name, ref in calls}
        pending = [ref for _, ref in calls]
        deadline = time.monotonic() + self.e.run.actor_timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                hung = ", ".join(names[r] for r in pending)
                raise RunError(f"{what}: no answer from {hung} within "
                               f"{self.e.run.actor_timeout_s:.0f} s", 3)  # fmt: skip
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

    def _all(self, actors: list[Any], label: str, method: str, *args, **kw) -> list[Any]:
        calls = [
            (
                f"{label} {i}" if label == "trainer rank" else f"engine{i}",
                getattr(a, method).remote(*args, **kw),
            )
            for i, a in enumerate(actors)
        ]
        return self._wait(calls, method)

    def setup(self) -> None:
        from onpolicy.checkpoint import torch_dist

        t0 = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out / "config.json", json.dumps(self.e.to_dict(), indent=1) + "\n")
        self.ckpt = checkpoint(self.e.cfg, self.out)
        self.resume_from = None
        if self.resume:
            root = self.out / "checkpoints"
            it = torch_dist.read_tracker(root) if root.exists() else None
            if it is None:
                raise RunError(f"--resume: no checkpoint under {root} (run.checkpoint_every "
                               "saves one every N steps)", 2)  # fmt: skip
            self.resume_from, self.start_step = root, it
        self._ray_init()
        self.times["ray_init_s"] = time.perf_counter() - t0
        self._place()
        starts = [(f"engine{i}", a.start.remote()) for i, a in enumerate(self.engines)]
        setups = [(f"trainer rank {g}", a.setup.remote()) for g, a in enumerate(self.trainers)]
        values = self._wait(starts + setups, "start")
        self.engine_info = values[: len(self.engines)]
        self.times["trainer_setup_s"] = max(v["setup_s"] for v in values[len(self.engines) :])
        pids = {name: v["pid"] for (name, _), v in zip(starts + setups, values, strict=True)}
        write_atomic(self.out / "actors.json", json.dumps(pids, indent=1) + "\n")
        proxies = [{"name": i["name"], "tp": i["tp"], "ep": i["ep"], "handle": h}
                   for i, h in zip(self.engine_info, self.engines, strict=True)]  # fmt: skip
        self._all(self.trainers, "trainer rank", "connect", proxies)
        if self.start_step:  # the engines hold the start checkpoint; give them the resumed one
            self._all(self.trainers, "trainer rank", "sync_weights", str(self.start_step),
                      self.e.grpo.verify_weights)  # fmt: skip
        self.times["setup_s"] = time.perf_counter() - t0

    # --- one step -------------------------------------------------------------------------------
    def sampling_seed(self, step: int, i: int) -> int:
        g = self.e.grpo
        return (g.seed * 1_000_003 + step) * (1 << 20) + i

    def rollout(self, step: int) -> list[dict]:
        from onpolicy.grpo.task import make_task

        g, shape = self.e.grpo, self.e.cfg.shape
        task = getattr(self, "task", None) or make_task(self.e.task, shape.vocab_size,
                                                        shape.eos_token_id)  # fmt: skip
        self.task = task
        prompts = task.prompts(step, g.prompts_per_step, g.seed)
        flat = [p for p in prompts for _ in range(g.samples_per_prompt)]
        seeds = [self.sampling_seed(step, i) for i in range(len(flat))]
        n_eng = len(self.engines)
        cuts = [len(flat) * k // n_eng for k in range(n_eng + 1)]
        calls = [(f"engine{k}", a.generate.remote([p.ids for p in flat[cuts[k]:cuts[k + 1]]],
                                                  seeds[cuts[k]:cuts[k + 1]],
                                                  temperature=g.temperature,
                                                  max_new_tokens=g.max_new_tokens,
                                                  ignore_eos=g.ignore_eos))
                 for k, a in enumerate(self.engines)]  # fmt: skip
        outs = [s | {"engine": k} for k, part in enumerate(self._wait(calls, "generate"))
                for s in part]  # fmt: skip
        for p, s, seed in zip(flat, outs, seeds, strict=True):
            s["prompt"], s["task_prompt"], s["seed"] = list(p.ids), p, seed
            s["reward"] = float(task.reward(p, s["output_ids"]))
        return outs

    def step(self, step: int) -> StepRecord:
        g = self.e.grpo
        t0 = time.perf_counter()
        samples = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        rewards = [s["reward"] for s in samples]
        adv = group_advantages(rewards, g.samples_per_prompt)
        seqs = [s["prompt"] + s["output_ids"] for s in samples]

        t1 = time.perf_counter()
        scored = self._all(self.trainers, "trainer rank", "score", seqs, g.routing_check)[0]
        t_score = time.perf_counter() - t1
        metrics: dict[str, Any] = logprob_metrics(samples, scored["logprobs"])
        versions = {s["weight_version"] for s in samples}
        metrics["rollout/weight_version"] = ",".join(sorted(str(v) for v in versions))
        if g.routing_check:
            metrics |= self._routing(samples, scored["routes"])
        violation = None
        if g.true_on_policy and (metrics["train/train_rollout_logprob_abs_diff"] != 0.0
                                 or metrics["train/train_rollout_kl"] != 0.0
                                 or metrics["train/logprob_equal_frac"] != 1.0):  # fmt: skip
            result = compare(samples, dict(enumerate(scored["logprobs"])), f"step {step}")
            violation = OnPolicyViolation(
                f"step {step}: true-on-policy broken: train_rollout_logprob_abs_diff = "
                f"{metrics['train/train_rollout_logprob_abs_diff']!r}, train_rollout_kl = "
                f"{metrics['train/train_rollout_kl']!r}, {result.equal} / {result.compared} "
                f"tokens equal; {result.first.describe() if result.first else ''}",
                result.first,
            )
            violation.samples, violation.step = samples, step
            violation.metrics = metrics
            raise violation

        if self._release:
            self._all(self.engines, "engine", "release_memory")
        batch = {
            "sequences": seqs,
            "response_starts": [len(s["prompt"]) for s in samples],
            "rollout_logprobs": [s["logprobs"] for s in samples],
            "advantages": adv,
        }
        trained = self._all(self.trainers, "trainer rank", "train", batch)[0]
        t_train = time.perf_counter() - t1
        if self._release:
            self._all(self.engines, "engine", "resume_memory")
        t2 = time.perf_counter()
        synced = self._all(self.trainers, "trainer rank", "sync_weights", str(step),
                           g.verify_weights)[0]  # fmt: skip
        t_sync = time.perf_counter() - t2
        lengths = [len(s["output_ids"]) for s in samples]
        metrics |= {
            "train/loss": trained["loss"], "train/pg_loss": trained["pg_loss"],
            "train/kl": trained["kl"], "train/clip_frac": trained["clip_frac"],
            "train/approx_kl": trained["approx_kl"], "train/ratio": trained["ratio"],
            "train/num_tokens": trained["num_tokens"], "grad_norm": trained["grad_norm"],
            "weight_version": step,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/std": _std(rewards),
            "response/length_mean": sum(lengths) / len(lengths),
            "response/length_max": max(lengths), "rollout/samples": len(samples),
            "sync/bytes": synced["bytes"], "sync/verified_boxes": synced["verified_boxes"],
            "time/rollout_s": t_rollout, "time/score_s": t_score, "time/train_s": t_train,
            "time/sync_s": t_sync, "time/step_s": time.perf_counter() - t0,
        }  # fmt: skip
        return StepRecord(step=step, metrics=metrics, samples=samples)

    @property
    def _release(self) -> bool:
        c = self.e.cfg
        return c.device == "cuda" and c.rollout.colocate

    def _routing(self, samples: list[dict], trainer_routes: list[torch.Tensor]) -> dict:
        from onpolicy.grpo.routing import routing_mismatch

        bad, rows = routing_mismatch([s["routed_experts"] for s in samples], trainer_routes)
        return {"train/routing_mismatch": bad / max(rows, 1), "train/routing_rows": rows}

    def bisect(self, v: OnPolicyViolation) -> str:
        """Rerun the first differing sample on its engine and on the trainer with per-layer
        captures; the first layer and op whose outputs differ.

        The engine reruns the sample's decode (same seed, same tokens). An engine whose sampler
        does not reproduce it (SGLang's stock sampler is not seeded per request) is captured
        instead on one prefill of the sampled sequence, which runs every position the trainer
        scores."""
        from onpolicy.grpo.bisect import first_divergence

        m = v.mismatch
        s = v.samples[m.sample]
        where = self.out / "bisect" / f"step{v.step}-sample{m.sample}"
        k, out = s["engine"], s["output_ids"]
        note = ""

        def capture(prompt: list[int], new_tokens: int) -> dict:
            request = {"prompts": [prompt], "new_tokens": new_tokens,
                       "temperature": self.e.grpo.temperature, "seed": s["seed"]}  # fmt: skip
            kw = {"request": request, "out_dir": str(where / "rollout")}
            call = self.engines[k].call.remote("capture_generate", kw)
            return self._wait([(f"engine{k}", call)], "bisect")[0]

        again = capture(s["prompt"], len(out))
        if again["output_ids"] != out:
            shutil.rmtree(where / "rollout")
            again = capture(s["prompt"] + out[:-1], 1)
            note = (f"; engine{k} did not resample the same tokens, so its capture is one "
                    "prefill of the sampled sequence")  # fmt: skip
        # The trainer scores exactly what the engine ran (the fallback's last token is new).
        self._all(self.trainers, "trainer rank", "capture", again["prompt"] + again["output_ids"],
                  str(where / "trainer"))  # fmt: skip
        div = first_divergence(where / "rollout", where / "trainer")
        if div is None:
            return (f"bisect: every captured point of sample {m.sample} is equal on the "
                    f"rerun; the difference is outside the captured ops (captures under "
                    f"{where}{note})")  # fmt: skip
        return f"bisect: sample {m.sample}: {div.describe()} (captures under {where}{note})"

    # --- the run --------------------------------------------------------------------------------
    def checkpoint_step(self, step: int) -> None:
        every = self.e.run.checkpoint_every
        if every and step % every == 0:
            root = str(self.out / "checkpoints")
            self._all(self.trainers, "trainer rank", "save", root, step)

    def params_digest(self) -> str:
        return self._all(self.trainers, "trainer rank", "params_digest")[0]

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
        left = reap(self.run_id) if self.started_ray else []
        self.times["teardown_s"] = time.perf_counter() - t0
        return left


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _error(ref: Any) -> BaseException | None:
    """The exception a finished call raised, None when it returned."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayError as err:  # a dead actor, a failed method, a lost result
        return err
    return None


def _cause(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    keep = [ln for ln in text if ln.strip()][:6]
    return " | ".join(keep)[:800]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, then rename it over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_processes(run_id: str) -> list[int]:
    """Pids of live processes (not this one) that carry the run's id in their environment."""
    found = []
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            found.append(int(d.name))
    return found


def reap(run_id: str, grace_s: float = 20.0) -> list[str]:
    """Wait for the run's processes to exit; kill and describe any still there after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = []
    for pid in run_processes(run_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            os.kill(pid, signal.SIGKILL)
            left.append(f"{pid} {cmd}")
        except OSError:
            pass
    return left
