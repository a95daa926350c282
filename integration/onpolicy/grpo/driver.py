"""The GRPO driver: the step loop and the true-on-policy assertion (the actors, Ray and teardown
are `onpolicy.grpo.cluster`'s).

One step (`Driver.step`):
1. every engine samples its share of the step's prompts x n, with log-probs, at temperature T,
   each sample ending at the task's stop ids or max_new_tokens;
2. the task scores every sample (the dataset task: decoded text, a reward in a process pool);
   with grpo.filter_groups, groups of equal rewards are dropped and refilled from the data
   stream (`onpolicy.grpo.filtering`);
3. group-normalised advantages;
4. the trainer scores the same sequences (and reports its routed expert ids); the driver
   compares each generated token's two fp32 log-probs as bits and computes the metrics; in
   true-on-policy mode any difference stops the run here, naming the first differing token;
5. one PPO-clip update on the rollout's log-probs as the sampling policy;
6. the weights go to every engine as version step (checked by digest when configured);
7. every eval.every steps and after the last, the eval prompts are sampled and scored, not
   trained on (`onpolicy.grpo.evaluation`).
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
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onpolicy.compare import Mismatch, compare, logprob_metrics
from onpolicy.contract import ContractError, model_checkpoint_path
from onpolicy.contract import model_checkpoint as checkpoint
from onpolicy.fsutil import LOCK_NAME, FolderLocked, lock_folder, write_atomic
from onpolicy.grpo.advantages import group_advantages
from onpolicy.grpo.cluster import Cluster, RunError, memory_saver_problem
from onpolicy.grpo.config import E2EConfig
from onpolicy.grpo.evaluation import eval_due, eval_metrics
from onpolicy.grpo.filtering import fill, select_groups
from onpolicy.grpo.memory import GpuReader, PhasePeaks, gpu_memory_used, run_rss_mib
from onpolicy.grpo.metrics import SCORE_COMPILES, TRAIN_COMPILES
from onpolicy.grpo.procs import RUN_ID_ENV
from onpolicy.grpo.rewards import RewardError, reward_metrics
from onpolicy.grpo.tasks import Task, TaskContext, make_task
from onpolicy.models.hf_layout import CheckpointError

EVAL_SEEDS = 1 << 19
"""Eval sample i of step s samples with seed `sampling_seed(s, EVAL_SEEDS + i)`: apart from the
step's training samples (fewer than 2^19)."""


class OnPolicyViolation(RunError):
    """A step's trainer log-probs differ from the rollout's (exit 1)."""

    def __init__(self, message: str, *, step: int, mismatch: Mismatch | None,
                 samples: list[dict], metrics: dict[str, Any]) -> None:  # fmt: skip
        super().__init__(message, 1)
        self.step = step
        """The step that broke the assertion."""
        self.mismatch = mismatch
        """The first differing token (None when only the metrics say so)."""
        self.samples = samples
        """The step's samples (what `Driver.bisect` reruns)."""
        self.metrics = metrics
        """The step's metrics up to the comparison."""


@dataclass
class StepRecord:
    """What one step produced (the driver's view)."""

    step: int
    metrics: dict[str, Any]
    samples: list[dict] = field(default_factory=list)


# --- the driver -------------------------------------------------------------------------------
class Driver:
    """The loop of one run: setup, steps, checkpoints, bisect; the cluster runs the actors."""

    def __init__(self, e: E2EConfig, *, resume: bool = False, last_step: int | None = None,
                 log=print, run_id: str | None = None) -> None:  # fmt: skip
        self.e, self.log = e, log
        self.out = e.out_dir
        self.resume = resume
        # A fresh id unless the caller names one: one inherited from the environment could
        # mark processes that are not the run's.
        run_id = run_id or uuid.uuid4().hex
        os.environ[RUN_ID_ENV] = run_id
        self.cluster = Cluster(e, run_id=run_id, authkey=secrets.token_hex(16))
        self.engine_info: list[dict] = []
        """Each engine's start report (name, tp, ep, ...)."""
        self.ckpt: Path | None = None
        """The HF checkpoint the run starts from."""
        self.resume_from: Path | None = None
        """The torch-dist checkpoint root `--resume` continues from."""
        self._lock = None
        """The run folder's lock (`fsutil.lock_folder`), held from setup to `release`."""
        self.start_step = 0
        """The last step already done (0 on a fresh run)."""
        self.task: Task | None = None
        """The prompt task, made in `setup` (the dataset task needs the checkpoint's tokenizer)."""
        self.cursor = 0
        """The dataset task's stream position: prompts the run has taken so far."""
        self.last_step = e.grpo.steps if last_step is None else last_step
        """The run's last step (it evaluates after it)."""
        self.times = self.cluster.times
        """Setup, Ray start, slowest trainer setup and teardown seconds (times.json)."""
        self.run_id = run_id
        self.peaks: PhasePeaks | None = None
        """The run's memory per phase of a step (`memory`), sampled from setup to teardown."""
        self._gpu_reader: GpuReader | None = None
        self.engine_kv_mib = 0
        """The engines' KV pools together (SGLang's account), MiB; 0 unless colocated on CUDA."""

    @property
    def trainers(self) -> list[Any]:
        return self.cluster.trainers

    @property
    def engines(self) -> list[Any]:
        return self.cluster.engines

    def _wait(self, calls: list[tuple[str, Any]], what: str) -> list[Any]:
        return self.cluster.wait(calls, what)

    def _all(self, actors: list[Any], label: str, method: str, *args, **kw) -> list[Any]:
        return self.cluster.all(actors, label, method, *args, **kw)

    def setup(self) -> None:
        t0 = time.perf_counter()
        # The folder is checked and locked before anything is written to it.
        if not self.resume and self.out.is_dir():
            found = sorted(p.name for p in self.out.iterdir() if p.name != LOCK_NAME)
            if found:
                names = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
                raise RunError(f"[run_out] run.out = {self.out} is not empty ({names}): pass "
                               "--resume to continue its run, or a new --out", 2)  # fmt: skip
        try:
            self._lock = lock_folder(self.out)
        except FolderLocked as err:
            raise RunError(f"[run_lock] {err}", 2) from None
        if self.resume:
            try:
                self._resume_point()
            except RunError:
                self.release()  # refused before any write: the folder keeps no trace of it
                raise
        problem = memory_saver_problem(self.e.cfg)  # before the run writes anything
        if problem:
            self.release()
            raise RunError(problem, 2)
        try:
            # The data is checked with the checkpoint's tokenizer, so the seeded checkpoint of a
            # fresh run comes first; config.json only once the data is accepted (a refused
            # resume keeps the run's own).
            self.ckpt = checkpoint(self.e.cfg, self.out)
            self._make_task()  # every problem with the data is refused here, before Ray starts
        except RunError:
            if not self.resume:  # the folder was empty: a refused run leaves it so
                self._clear_out()
            self.release()
            raise
        write_atomic(self.out / "config.json", json.dumps(self.e.to_dict(), indent=1) + "\n")
        self._start_peaks()
        self.engine_info = self.cluster.start(self.ckpt, self.resume_from)
        if self.cluster.releases_memory:
            usage = self._all(self.engines, "engine", "memory_usage")
            self.engine_kv_mib = sum(round(u["kvcache"] * 1024) for u in usage)
            self.log("onpolicy e2e: engine memory (GB): " + "; ".join(
                f"engine{i} weight {u['weight']}, kvcache {u['kvcache']}, graph "
                f"{sum(u['graph'].values()):.3f}" for i, u in enumerate(usage)))  # fmt: skip
        write_atomic(self.out / "actors.json", json.dumps(self.cluster.pids, indent=1) + "\n")
        proxies = [{"name": i["name"], "tp": i["tp"], "ep": i["ep"], "handle": h}
                   for i, h in zip(self.engine_info, self.engines, strict=True)]  # fmt: skip
        self._all(self.trainers, "trainer rank", "connect", proxies)
        warmed = self.cluster.warm_up() is not None
        # The engines hold the start checkpoint: a resume gives them the resumed weights. After
        # a warm-up they get the trainer's again: an engine that released its memory holds
        # none, and elsewhere the sync's verify shows the warm-up left the weights as loaded.
        if self.start_step or warmed:
            version = str(self.start_step) if self.start_step else self.engine_info[0][
                "weight_version"]  # fmt: skip
            self._all(self.trainers, "trainer rank", "sync_weights", version,
                      self.e.grpo.verify_weights)  # fmt: skip
        self.times["setup_s"] = time.perf_counter() - t0

    def _start_peaks(self) -> None:
        if self.e.cfg.device == "cuda":
            try:
                self._gpu_reader = GpuReader()
            except (RuntimeError, OSError) as err:  # the run goes on without them
                self.log(f"onpolicy e2e: GPU memory per phase not recorded: {err}")
                return
            self.peaks = PhasePeaks(self._gpu_reader)
        else:
            self.peaks = PhasePeaks(lambda: run_rss_mib(self.run_id))

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """One phase of a step: its seconds into `self._seconds` (time/<name>_s) and, sampled
        meanwhile, its lowest and peak memory (memory/<name>_low_mib, _peak_mib)."""
        t = time.perf_counter()
        with self.peaks.phase(name) if self.peaks is not None else nullcontext():
            yield
        self._seconds[name] = time.perf_counter() - t

    def _resume_point(self) -> None:
        """Where `--resume` continues: `latest`, checked (exit 2 if unreadable, missing or not
        before the run's last step); saves newer than it are set aside."""
        from onpolicy.checkpoint import torch_dist

        root = self.out / "checkpoints"
        try:
            it = torch_dist.read_tracker(root) if root.exists() else None
        except CheckpointError as err:
            raise RunError(f"--resume: {err}", 2) from None
        if it is None:
            raise RunError(f"--resume: no checkpoint under {root} (run.checkpoint_every "
                           "saves one every N steps)", 2)  # fmt: skip
        if it >= self.last_step:
            raise RunError(f"[resume_step] --resume: `latest` is step {it} and the run is "
                           f"{self.last_step} steps: nothing left to run; ask for more with "
                           "--steps or grpo.steps", 2)  # fmt: skip
        cfg = self.e.cfg
        model = model_checkpoint_path(cfg, self.out)
        if not cfg.model.hf_path and not model.is_dir():  # never a second seeded model here
            held = sorted(p.name for p in self.out.glob("tiny-seed*")) or ["none"]
            raise RunError(f"[resume_model] --resume: the config's [model] (seed "
                           f"{cfg.model.seed}, its shape) is not the run's: no {model.name} in "
                           f"{self.out} (it holds {', '.join(held)}); resume with the run's "
                           "config.json", 2)  # fmt: skip
        self.resume_from, self.start_step = root, it
        for old, new in torch_dist.set_aside_newer(root):
            self.log(f"onpolicy e2e: warning: {old.name} is newer than `latest` ({it}), a save "
                     f"that did not finish publishing; moved aside to {new.name}")  # fmt: skip

    def _make_task(self) -> None:
        """The task, its data read and checked (a refusal is exit 2), and where the stream
        continues on a resumed run."""
        e, shape = self.e, self.e.cfg.shape
        g = e.grpo
        context = TaskContext(checkpoint=self.ckpt, data=e.data, reward=e.reward, seed=g.seed)
        try:
            self.task = make_task(e.task, shape.vocab_size, shape.eos_token_id, context)
            if self._dataset and not g.filter_groups:
                self.task.check_length(self.last_step * g.prompts_per_step)
        except (ContractError, ValueError) as err:
            raise RunError(f"{err}", 2) from None
        if not self._dataset:
            return
        t = self.task
        info = {"train_file": t.train.path, "train_rows": t.train.total,
                "train_prompts": len(t.train.rows), "train_dropped_long": t.train.dropped_long,
                "eval_file": t.eval.path if t.eval else "",
                "eval_rows": t.eval.total if t.eval else 0,
                "eval_prompts": len(t.eval.rows) if t.eval else 0,
                "eval_dropped_long": t.eval.dropped_long if t.eval else 0,
                "stop_token_ids": t.stop_token_ids()}  # fmt: skip
        write_atomic(self.out / "data.json", json.dumps(info, indent=1) + "\n")
        self.log(f"onpolicy e2e: data: {info['train_prompts']} of {info['train_rows']} training "
                 f"prompts ({info['train_dropped_long']} longer than data.max_prompt_tokens = "
                 f"{e.data.max_prompt_tokens} dropped)" +
                 (f", {info['eval_prompts']} of {info['eval_rows']} eval prompts "
                  f"({info['eval_dropped_long']} dropped)" if t.eval else "") +
                 f"; stop ids {info['stop_token_ids']}")  # fmt: skip
        self.cursor = self.start_step * g.prompts_per_step
        if self.start_step and g.filter_groups:  # refills moved the stream: read where it is
            state = self._data_state(self.start_step)
            if not state.is_file():
                raise RunError(f"--resume: no data stream position {state} for step "
                               f"{self.start_step}", 2)  # fmt: skip
            self.cursor = json.loads(state.read_text())["cursor"]

    @property
    def _dataset(self) -> bool:
        return self.e.task.name == "dataset"

    def _data_state(self, step: int) -> Path:
        return self.out / "checkpoints" / "data" / f"iter_{step:07d}.json"

    # --- one step -------------------------------------------------------------------------------
    def sampling_seed(self, step: int, i: int) -> int:
        g = self.e.grpo
        return (g.seed * 1_000_003 + step) * (1 << 20) + i

    def generate(self, step: int, prompts: list, n: int, *, first_seed: int, temperature: float,
                 max_new_tokens: int, what: str = "generate") -> list[dict]:  # fmt: skip
        """Every prompt sampled n times over the engines (contiguous shares), sample i with
        seed `sampling_seed(step, first_seed + i)`, then scored by the task: per sample its
        prompt, output ids, log-probs, finish reason, reward (and the task's per-sample
        metrics and decoded text)."""
        g, task = self.e.grpo, self.task
        flat = [p for p in prompts for _ in range(n)]
        seeds = [self.sampling_seed(step, first_seed + i) for i in range(len(flat))]
        n_eng = len(self.engines)
        cuts = [len(flat) * k // n_eng for k in range(n_eng + 1)]
        stop = task.stop_token_ids()
        calls = [(f"engine{k}", a.generate.remote([p.ids for p in flat[cuts[k]:cuts[k + 1]]],
                                                  seeds[cuts[k]:cuts[k + 1]],
                                                  temperature=temperature,
                                                  max_new_tokens=max_new_tokens,
                                                  ignore_eos=g.ignore_eos, stop_token_ids=stop))
                 for k, a in enumerate(self.engines)]  # fmt: skip
        outs = [s | {"engine": k} for k, part in enumerate(self._wait(calls, what))
                for s in part]  # fmt: skip
        try:
            scores = task.score(flat, [s["output_ids"] for s in outs])
        except RewardError as err:  # never scored 0: the run stops naming the sample
            raise RunError(f"step {step} ({what}): {err}", 3) from None
        for p, s, seed, sc in zip(flat, outs, seeds, scores, strict=True):
            s["prompt"], s["task_prompt"], s["seed"] = list(p.ids), p, seed
            s["reward"], s["reward_metrics"], s["text"] = float(sc.reward), sc.metrics, sc.text
        return outs

    def rollout(self, step: int) -> tuple[list[dict], dict[str, Any]]:
        """The step's samples (groups of samples_per_prompt, contiguous) and the filtering
        metrics; the dataset task's stream moves on by the prompts taken."""
        g, n, want = self.e.grpo, self.e.grpo.samples_per_prompt, self.e.grpo.prompts_per_step

        def sample(prompts: list, batch: int) -> list[dict]:
            return self.generate(step, prompts, n, first_seed=batch * want * n,
                                 temperature=g.temperature,
                                 max_new_tokens=g.max_new_tokens)  # fmt: skip

        if not g.filter_groups:
            samples = sample(self.task.prompts(step, want, g.seed), 0)
            self.cursor += want
            return samples, {}
        collected: list[dict] = []
        batches = 0
        while True:
            try:
                prompts = self.task.prompts_at(self.cursor, want)
            except ContractError as err:  # the stream ran out (data.epochs)
                raise RunError(f"step {step}: {err}", 2) from None
            self.cursor += want
            collected += sample(prompts, batches)
            batches += 1
            kept, dropped = select_groups([s["reward"] for s in collected], n, want)
            if len(kept) >= want or batches >= g.filter_max_batches:
                break
        groups = fill(kept, dropped, want)
        for i, s in enumerate(collected):
            s["trained"] = i // n in groups
        samples = [s for grp in groups for s in collected[grp * n : (grp + 1) * n]]
        metrics = {"filter/dropped_groups": len(dropped), "filter/batches": batches,
                   "filter/topped_up": max(want - len(kept), 0)}  # fmt: skip
        self._dropped = [s for s in collected if not s["trained"]]
        return samples, metrics

    def evaluate(self, step: int) -> dict[str, Any]:
        """The eval/ metrics of the eval prompts, sampled and scored (not trained on)."""
        v, g = self.e.eval, self.e.grpo
        t0 = time.perf_counter()
        prompts = self.task.eval_prompts(v.max_prompts)
        samples = self.generate(step, prompts, v.samples_per_prompt, first_seed=EVAL_SEEDS,
                                temperature=v.temperature,
                                max_new_tokens=v.max_new_tokens or g.max_new_tokens,
                                what="eval")  # fmt: skip
        truncated = [s.get("finish") == "length" for s in samples]
        metrics = eval_metrics([s["reward"] for s in samples], v.samples_per_prompt,
                               v.pass_threshold, truncated)  # fmt: skip
        extra = reward_metrics([s["reward_metrics"] for s in samples])
        metrics |= {f"eval/{k.removeprefix('reward/')}": x for k, x in extra.items()
                    if f"eval/{k.removeprefix('reward/')}" not in metrics}  # fmt: skip
        self._save_samples(f"eval_{step:07d}", samples)
        return metrics | {"time/eval_s": time.perf_counter() - t0}

    def _save_samples(self, name: str, samples: list[dict]) -> None:
        """samples/<name>.jsonl (run.save_samples): what each sample was given and produced."""
        if not self.e.run.save_samples:
            return
        lines = []
        for i, s in enumerate(samples):
            p = s["task_prompt"]
            lines.append(json.dumps({
                "sample": i, "prompt_index": p.index, "row": p.row, "label": p.label,
                "prompt_text": p.text, "prompt_ids": s["prompt"], "output_ids": s["output_ids"],
                "response": s["text"], "finish": s.get("finish"), "reward": s["reward"],
                "reward_metrics": s["reward_metrics"], "seed": s["seed"], "engine": s["engine"],
                "trained": s.get("trained", not name.startswith("eval")),
            }, default=str, ensure_ascii=False) + "\n")  # fmt: skip
        (self.out / "samples").mkdir(exist_ok=True)
        write_atomic(self.out / "samples" / f"{name}.jsonl", "".join(lines))

    def step(self, step: int) -> StepRecord:
        g = self.e.grpo
        t0 = time.perf_counter()
        self._dropped: list[dict] = []
        self._seconds: dict[str, float] = {}
        with self._phase("rollout"):
            samples, filtered = self.rollout(step)
        self._save_samples(f"step_{step:07d}", samples + self._dropped)
        rewards = [s["reward"] for s in samples]
        adv = group_advantages(rewards, g.samples_per_prompt)
        seqs = [s["prompt"] + s["output_ids"] for s in samples]

        with self._phase("score"):
            scored = self._all(self.trainers, "trainer rank", "score", seqs, g.routing_check)[0]
        scores = [torch.tensor(v) for v in scored["logprobs"]]  # a copy: Ray's are read-only
        metrics: dict[str, Any] = logprob_metrics(samples, scores)
        if scored["compiles"] is not None:
            metrics[SCORE_COMPILES] = scored["compiles"]
        versions = {s["weight_version"] for s in samples}
        metrics["rollout/weight_version"] = ",".join(sorted(str(v) for v in versions))
        if g.routing_check:
            metrics |= self._routing(samples, [torch.tensor(r) for r in scored["routes"]])
        if g.true_on_policy and (metrics["train/train_rollout_logprob_abs_diff"] != 0.0
                                 or metrics["train/train_rollout_kl"] != 0.0
                                 or metrics["train/logprob_equal_frac"] != 1.0):  # fmt: skip
            result = compare(samples, dict(enumerate(scores)), f"step {step}")
            raise OnPolicyViolation(
                f"step {step}: true-on-policy broken: train_rollout_logprob_abs_diff = "
                f"{metrics['train/train_rollout_logprob_abs_diff']!r}, train_rollout_kl = "
                f"{metrics['train/train_rollout_kl']!r}, {result.equal} / {result.compared} "
                f"tokens equal; {result.first.describe() if result.first else ''}",
                step=step, mismatch=result.first, samples=samples, metrics=metrics,
            )  # fmt: skip

        if self.cluster.releases_memory:
            before = self._gpu_total()
            with self._phase("release"):
                self._all(self.engines, "engine", "release_memory")
            after = self._gpu_total()
            if before is not None and after is not None:  # fresh readings, the trainer idle
                metrics["memory/released_mib"] = before - after
                metrics["memory/engine_kv_mib"] = self.engine_kv_mib
        batch = {
            "sequences": seqs,
            "response_starts": [len(s["prompt"]) for s in samples],
            "rollout_logprobs": [s["logprobs"] for s in samples],
            "advantages": adv,
        }
        with self._phase("train"):
            trained = self._all(self.trainers, "trainer rank", "train", batch)[0]
        if trained["compiles"] is not None:
            metrics[TRAIN_COMPILES] = trained["compiles"]
        if self.cluster.releases_memory:
            with self._phase("resume"):
                self._all(self.engines, "engine", "resume_memory")
        with self._phase("sync"):
            synced = self._all(self.trainers, "trainer rank", "sync_weights", str(step),
                               g.verify_weights)[0]  # fmt: skip
        lengths = [len(s["output_ids"]) for s in samples]
        metrics |= filtered | reward_metrics([s["reward_metrics"] for s in samples])
        truncated = sum(s.get("finish") == "length" for s in samples)
        metrics["response/truncated_frac"] = truncated / len(samples)
        if self._dataset:
            metrics["data/position"] = self.cursor
            metrics["data/epoch"] = (self.cursor - 1) // len(self.task.train.rows)
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
            # generated tokens over the rollout's wall time; trained tokens over train's
            "perf/rollout_tokens_per_s": sum(lengths) / self._seconds["rollout"],
            "perf/train_tokens_per_s": trained["num_tokens"] / self._seconds["train"],
        }  # fmt: skip
        if synced["weights_sha256"]:  # equal digests: the engines were given the same bits
            metrics["sync/weights_sha256"] = synced["weights_sha256"]
            metrics["time/sync_verify_s"] = synced["verify_seconds"]  # within time/sync_s
        metrics |= {f"time/{k}_s": v for k, v in self._seconds.items()}
        if self.peaks is not None:
            for k, (low, peak) in self.peaks.take().items():
                metrics |= {f"memory/{k}_low_mib": low, f"memory/{k}_peak_mib": peak}
        v = self.e.eval
        evals = self._dataset and self.task.eval is not None
        if evals and eval_due(step, self.last_step, v.every):
            metrics |= self.evaluate(step)
        metrics["time/step_s"] = time.perf_counter() - t0
        return StepRecord(step=step, metrics=metrics, samples=samples)

    def _gpu_total(self) -> int | None:
        """The host's GPU memory in use now, MiB (a fresh nvidia-smi reading, not the sampled
        one); None where nvidia-smi gives no answer, which loses the metric, not the run."""
        if self._gpu_reader is None:
            return None
        try:
            return sum(gpu_memory_used())
        except RuntimeError:
            return None

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
            if self._dataset:  # before the save: `latest` never names a step without it
                self._data_state(step).parent.mkdir(parents=True, exist_ok=True)
                write_atomic(self._data_state(step), json.dumps({"cursor": self.cursor}) + "\n")
            self._all(self.trainers, "trainer rank", "save", root, step)

    def params_digest(self) -> str:
        return self._all(self.trainers, "trainer rank", "params_digest")[0]

    def teardown(self, graceful: bool = True) -> list[str]:
        """Stop every actor and the local Ray head; the processes of the run that had to be
        killed, named (see `Cluster.teardown`)."""
        if self.peaks is not None:
            self.peaks.close()
        if self._gpu_reader is not None:
            self._gpu_reader.close()
        if self.task is not None:
            self.task.close()  # the reward pool's processes carry the run's id too
        return self.cluster.teardown(graceful)

    def _clear_out(self) -> None:
        """Remove what this fresh run wrote before a refusal (setup found its folder empty)."""
        for p in self.out.iterdir():
            if p.name == LOCK_NAME:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    @property
    def owns_out(self) -> bool:
        """Whether this run holds its folder's lock (it may write there)."""
        return self._lock is not None

    def release(self) -> None:
        """Release the run folder's lock (after the run's last write)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
