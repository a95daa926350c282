"""The GRPO run's config: the contract's run config plus the loop's own tables, read once.

One TOML file holds both. [model], [training] and [rollout] are the contract's
(`onpolicy.contract.RunConfig`, checked by its rules); the loop reads the rest:

    [grpo]       steps, batch shape, sampling, the true-on-policy assertion   GRPOConfig
    [loss]       PPO-clip and the optional KL term                            PPOClipConfig
    [optimizer]  Adam, clipping, the distributed optimizer                    OptimizerSettings
    [sync]       how weights reach the engines                                SyncConfig
    [task]       the prompt task (`name` picks it: band, dataset)             Task.Config
    [data]       the dataset task's files, columns, template, order           DataConfig
    [reward]     the reward: math, a custom function, or band's own rule      RewardConfig
    [eval]       evaluation on data.eval_file every N steps and at the end    EvalConfig
    [run]        run directory, checkpoints, Ray, bind address, sinks           RunSettings

`[task] name = "band"` (the default) generates its prompts and scores ids by its own rule: it
takes no [data], and its reward is "band". `[task] name = "dataset"` reads [data] (a train file
is required) and [reward] ("math", the default, or "custom").

Every key is typed; an unknown, missing or mistyped key, a value outside its range, or a
layout the contract's rules refuse, is a `ContractError` naming the key or the rule.
`--set section.key=value` overrides any of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onpolicy.contract.config import (
    LOOP_SECTIONS,
    RunConfig,
    apply_overrides,
    config_from_dict,
    from_dict,
    read_toml,
)
from onpolicy.contract.errors import ContractError
from onpolicy.contract.rules import validate
from onpolicy.grpo.data import DataConfig
from onpolicy.grpo.evaluation import EvalConfig
from onpolicy.grpo.ray_auth import check_environment
from onpolicy.grpo.rewards import RewardConfig, load_reward, reward_path
from onpolicy.grpo.tasks import task_config, task_table
from onpolicy.train.loss import PPOClipConfig
from onpolicy.train.step import OptimizerSettings
from onpolicy.weights.sync import SyncConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """The loop: how many steps, how big a step is, how it samples, what it asserts."""

    steps: int = 2
    """Optimizer steps (each: rollout, reward, advantages, scoring, update, weight sync)."""
    prompts_per_step: int = 4
    """Prompts sampled per step."""
    samples_per_prompt: int = 4
    """Samples per prompt (the GRPO group size n)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores at the same one."""
    max_new_tokens: int = 16
    """Tokens generated per sample at most (fewer when it samples EOS)."""
    ignore_eos: bool = False
    """Generate max_new_tokens even past EOS."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed trainer micro-batch."""
    compile_warmup: str = "cuda"
    """When every trainer rank scores and trains on the warm-up batches before step 1 (no optimizer
    step), so both forwards' Triton variants compile then: "cuda" (on CUDA only; on CPU nothing
    compiles), "always" or "never". Exact CUDA engines warm up their prefill as they start
    unless it is "never"."""
    seed: int = 0
    """Seed of the prompts and of every sample's sampling seed."""
    true_on_policy: bool = True
    """Stop the run at the first step whose abs_diff or kl is not 0.0."""
    rollout_path: str = "exact"
    """"exact": the engines run the onpolicy ops; "stock": SGLang's own path, on CPU or CUDA
    (the negative control of the assertion: the run must stop at step 1)."""
    verify_weights: bool = True
    """After every sync, check each engine rank's weights against the trainer's by digest."""
    routing_check: bool = True
    """Compare the rollout's routed expert ids with the trainer's at every step."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal and refill from the data stream (DAPO's dynamic
    sampling; the dataset task only; `onpolicy.grpo.filtering`)."""
    filter_max_batches: int = 4
    """With filter_groups: prompt batches (of prompts_per_step) one step samples at most."""
    engine_mem_fraction: float = 0.5
    """SGLang's mem_fraction_static on GPU: the share of memory for weights and KV cache. A CPU
    engine's KV pool is a fixed number of tokens instead (`rollout.exact_engine_args`), so its
    start does not depend on what the processes beside it take meanwhile."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """Where the run writes, how it connects, and which sinks it feeds."""

    out: str = ""
    """Run directory; "" is runs/<config name>."""
    checkpoint_every: int = 0
    """Save the trainer (model and optimizer) every N steps; 0 never."""
    ray_address: str = ""
    """"" starts a local Ray head on bind_address; otherwise ray.init(address=...)."""
    ray_auth: bool = True
    """Token auth on the run's Ray cluster (`onpolicy.grpo.ray_auth`); false only on a host where
    no other user can reach the head."""
    bind_address: str = "127.0.0.1"
    """Address every listener of the run binds: Ray's head, the torch.distributed
    rendezvous, the weight-sync group."""
    wandb_project: str = "onpolicy"
    """wandb project."""
    wandb_mode: str = "auto"
    """"auto" (online when WANDB_API_KEY is set, else offline), "offline", "online",
    "disabled"."""
    progress: bool = True
    """Show a progress bar of the run's steps."""
    cache_dir: str = ""
    """SGLang's and inductor's compile caches, shared by runs (a warm cache saves the engines'
    first-step compiles); "" is $XDG_CACHE_HOME/onpolicy or ~/.cache/onpolicy."""
    actor_timeout_s: float = 1800.0
    """Seconds one actor call (a rollout, a training step, a sync) may take before the run
    counts its actor as hung and stops."""
    start_timeout_s: float = 1800.0
    """Seconds the start may take (the placement group, every engine's start and every
    trainer's setup: loading the weights) before the run counts the actors not ready as hung."""
    save_samples: bool = False
    """Write every step's samples (prompt, response ids and text, reward) to
    samples/step_NNNNNNN.jsonl, and the eval samples to samples/eval_NNNNNNN.jsonl."""


@dataclass(frozen=True, kw_only=True, slots=True)
class E2EConfig:
    """A whole GRPO run."""

    cfg: RunConfig
    """The contract's part: model, device, the trainer and rollout layouts."""
    grpo: GRPOConfig
    loss: PPOClipConfig
    optimizer: OptimizerSettings
    sync: SyncConfig
    task: Any
    """The task's own config (`onpolicy.grpo.tasks`: the class `[task] name` selects)."""
    data: DataConfig
    reward: RewardConfig
    """Its name resolved ("" -> the task's own)."""
    eval: EvalConfig
    run: RunSettings
    source: str = ""
    """The config file it was read from."""

    @property
    def out_dir(self) -> Path:
        return Path(self.run.out or f"runs/{self.cfg.name or 'run'}")

    @property
    def cache_dir(self) -> Path:
        if self.run.cache_dir:
            return Path(self.run.cache_dir)
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "onpolicy"

    def to_dict(self) -> dict:
        """The resolved config as TOML-shaped data (written to the run directory)."""
        cfg = dataclasses.asdict(self.cfg)
        cfg.pop("shape", None)
        cfg["training"] = {k: v for k, v in cfg["training"].items() if k not in ("cp", "dp")}
        out = {**cfg}
        for section in LOOP_SECTIONS:
            value = getattr(self, section)
            out[section] = task_table(value) if section == "task" else dataclasses.asdict(value)
        return out


_TYPES = {"grpo": GRPOConfig, "loss": PPOClipConfig, "optimizer": OptimizerSettings,
          "sync": SyncConfig, "data": DataConfig, "reward": RewardConfig, "eval": EvalConfig,
          "run": RunSettings}  # fmt: skip

REWARDS = {"band": ("band",), "dataset": ("math", "custom")}
"""The rewards each task takes, its default first."""


def _check(e: E2EConfig) -> None:
    g, r = e.grpo, e.run
    positive = {"grpo.steps": g.steps, "grpo.prompts_per_step": g.prompts_per_step,
                "grpo.samples_per_prompt": g.samples_per_prompt,
                "grpo.max_new_tokens": g.max_new_tokens,
                "grpo.micro_batch_tokens": g.micro_batch_tokens}  # fmt: skip
    for key, value in positive.items():
        if value < 1:
            raise ContractError("grpo_config", f"{key} = {value} must be at least 1", f"set {key}")
    if not (g.temperature > 0 and math.isfinite(g.temperature)):
        raise ContractError(
            "grpo_config",
            f"grpo.temperature = {g.temperature} must be finite and above 0",
            "sample at a positive temperature (the trainer scores at it)",
        )
    if g.seed < 0:
        raise ContractError("grpo_config", f"grpo.seed = {g.seed}", "set a seed of 0 or more")
    if not 0.0 < g.engine_mem_fraction < 1.0:
        raise ContractError("grpo_config", f"grpo.engine_mem_fraction = {g.engine_mem_fraction}",
                            "set a fraction between 0 and 1")  # fmt: skip
    if g.compile_warmup not in ("cuda", "always", "never"):
        raise ContractError("grpo_config", f"grpo.compile_warmup = {g.compile_warmup!r}",
                            "set it to 'cuda', 'always' or 'never'")  # fmt: skip
    if g.rollout_path not in ("exact", "stock"):
        raise ContractError("grpo_config", f"grpo.rollout_path = {g.rollout_path!r}",
                            "set it to 'exact' or 'stock'")  # fmt: skip
    for key in ("actor_timeout_s", "start_timeout_s"):
        if not (getattr(r, key) > 0 and math.isfinite(getattr(r, key))):
            raise ContractError("run_config", f"run.{key} = {getattr(r, key)}",
                                "set the seconds it may take: finite, above 0")  # fmt: skip
    if r.checkpoint_every < 0:
        raise ContractError("run_config", f"run.checkpoint_every = {r.checkpoint_every}",
                            "set 0 (never) or a positive step count")  # fmt: skip
    if r.wandb_mode not in ("auto", "offline", "online", "disabled"):
        raise ContractError("run_config", f"run.wandb_mode = {r.wandb_mode!r}",
                            "set auto, offline, online or disabled")  # fmt: skip
    if not r.bind_address:
        raise ContractError(
            "run_config",
            "run.bind_address is empty",
            "set 127.0.0.1, or the address other hosts reach this one at",
        )
    check_environment(r.ray_auth, r.ray_address)  # [ray_auth]: RAY_AUTH_MODE, a joined token
    _check_data(e)
    if e.sync.transport == "tensor" and not e.cfg.rollout.colocate:
        raise ContractError(
            "sync_config",
            "sync.transport = 'tensor' needs colocated engines (rollout.colocate = true)",
            "use sync.transport = 'distributed'",
        )
    want = "nccl" if e.cfg.device == "cuda" else "gloo"
    if e.sync.backend != want:
        raise ContractError("sync_config", f"sync.backend = {e.sync.backend!r} on device "
                            f"{e.cfg.device!r}", f"set sync.backend = {want!r}")  # fmt: skip


def _resolve_reward(task: str, reward: RewardConfig) -> RewardConfig:
    """[reward] name "" as the task's own; a name the task does not take is refused."""
    allowed = REWARDS.get(task, ())
    name = reward.name or (allowed[0] if allowed else "")
    if name not in ("band", "math", "custom"):
        raise ContractError("reward_config", f"reward.name = {reward.name!r}",
                            "set 'math', 'custom' or 'band'")  # fmt: skip
    if name not in allowed:
        raise ContractError(
            "reward_task",
            f"reward.name = {name!r} with [task] name = {task!r}, which takes "
            f"{' or '.join(repr(a) for a in allowed)}",
            "the band task scores ids by its own rule; math and custom rewards read the text of "
            "[task] name = 'dataset'",
        )
    if (name == "custom") != bool(reward.path):
        raise ContractError(
            "reward_config",
            f"reward.path = {reward.path!r} with reward.name = {name!r}",
            "set reward.path = 'package.module:function' for name = 'custom', and only then",
        )
    if reward.workers < 1 or not (reward.timeout_s > 0 and math.isfinite(reward.timeout_s)):
        raise ContractError("reward_config", f"reward.workers = {reward.workers}, "
                            f"reward.timeout_s = {reward.timeout_s}",
                            "set at least 1 worker and a positive timeout")  # fmt: skip
    if name == "custom":
        load_reward(reward_path(reward))  # reward_path / reward_signature, before anything runs
    return dataclasses.replace(reward, name=name)


def _sync_at_bind_address(table: dict, sections: dict) -> SyncConfig:
    """[sync] with its rendezvous on run.bind_address: nothing of the run listens elsewhere, so
    a sync.address that names another address is refused rather than followed."""
    sync, bind = sections["sync"], sections["run"].bind_address
    if "address" in table and sync.address != bind:
        raise ContractError(
            "sync_address",
            f"sync.address = {sync.address!r} differs from run.bind_address = {bind!r}",
            "leave sync.address out: the weight-sync group listens on run.bind_address",
        )
    return dataclasses.replace(sync, address=bind)


def _check_data(e: E2EConfig) -> None:
    d, v, g = e.data, e.eval, e.grpo
    dataset = e.task.name == "dataset"
    if not dataset and (d.train_file or d.eval_file):
        raise ContractError(
            "data_task",
            f"[data] names files ({d.train_file or d.eval_file!r}) but [task] name = "
            f"{e.task.name!r} generates its own prompts",
            "set [task] name = 'dataset' to train on the files, or remove them",
        )
    if dataset and not d.train_file:
        raise ContractError("data_task", "[task] name = 'dataset' without data.train_file",
                            "set data.train_file to a local .jsonl or .parquet file")  # fmt: skip
    if d.epochs < 1 or d.max_prompt_tokens < 1:
        raise ContractError("data_config", f"data.epochs = {d.epochs}, data.max_prompt_tokens = "
                            f"{d.max_prompt_tokens}", "set both to at least 1")  # fmt: skip
    if not (d.prompt_key and d.label_key) or d.prompt_key == d.label_key:
        raise ContractError("data_config", f"data.prompt_key = {d.prompt_key!r}, data.label_key "
                            f"= {d.label_key!r}", "name two different columns")  # fmt: skip
    for key, value in {"eval.every": v.every, "eval.max_new_tokens": v.max_new_tokens,
                       "eval.max_prompts": v.max_prompts}.items():  # fmt: skip
        if value < 0:
            raise ContractError("eval_config", f"{key} = {value}", "set 0 or more")
    if v.samples_per_prompt < 1 or not (v.temperature >= 0 and math.isfinite(v.temperature)):
        raise ContractError(
            "eval_config",
            f"eval.samples_per_prompt = {v.samples_per_prompt}, eval.temperature = {v.temperature}",
            "sample at least once, at a temperature of 0 (greedy) or more",
        )
    if not math.isfinite(v.pass_threshold):
        raise ContractError("eval_config", f"eval.pass_threshold = {v.pass_threshold}",
                            "set a finite reward a sample must reach to pass")  # fmt: skip
    if v.every and not d.eval_file:
        raise ContractError("eval_config", f"eval.every = {v.every} without data.eval_file",
                            "set data.eval_file, or eval.every = 0")  # fmt: skip
    if g.filter_groups and not dataset:
        raise ContractError("grpo_config", "grpo.filter_groups with [task] name = "
                            f"{e.task.name!r}", "group filtering refills from [data]: use "
                            "[task] name = 'dataset'")  # fmt: skip
    if g.filter_max_batches < 1:
        raise ContractError("grpo_config", f"grpo.filter_max_batches = {g.filter_max_batches}",
                            "set at least 1")  # fmt: skip


def e2e_config_from_dict(data: dict, overrides: dict[str, object] | None = None,
                         source: str = "") -> E2EConfig:  # fmt: skip
    """The run from TOML data and dotted-key overrides; every section checked."""
    data = apply_overrides(data, overrides)
    cfg = config_from_dict(data)
    validate(cfg)
    sections = {}
    for name, cls in _TYPES.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ContractError(
                "config_types", f"{name!r} must be a table", f"write it as [{name}]"
            )
        try:
            sections[name] = from_dict(cls, table, f"{name}.")
        except ContractError:
            raise
        except ValueError as err:  # a section's own range check (__post_init__)
            raise ContractError(f"{name}_config", str(err), f"fix [{name}]") from None
    task = data.get("task", {})
    if not isinstance(task, dict):
        raise ContractError("config_types", "'task' must be a table", "write it as [task]")
    sections["task"] = task_config(task)
    sections["reward"] = _resolve_reward(sections["task"].name, sections["reward"])
    sections["sync"] = _sync_at_bind_address(data.get("sync", {}), sections)
    e = E2EConfig(cfg=cfg, source=source, **sections)
    _check(e)
    return e


def load_e2e_config(path: str | Path, overrides: dict[str, object] | None = None) -> E2EConfig:
    """Read a GRPO run from a TOML file; `overrides` (dotted keys) win."""
    return e2e_config_from_dict(read_toml(path), overrides, str(path))
