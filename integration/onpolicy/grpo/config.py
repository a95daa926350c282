"""The GRPO run's config: the contract's run config plus the loop's own tables, read once.

One TOML file holds both. [model], [training] and [rollout] are the contract's
(`onpolicy.contract.RunConfig`, checked by its rules); the loop reads the rest:

    [grpo]       steps, batch shape, sampling, the true-on-policy assertion   GRPOConfig
    [loss]       PPO-clip and the optional KL term                            PPOClipConfig
    [optimizer]  Adam, clipping, the distributed optimizer                    OptimizerSettings
    [sync]       how weights reach the engines                                SyncConfig
    [task]       the prompt task and its reward (`name` picks it)             Task.Config
    [run]        run directory, checkpoints, Ray, bind address, sinks           RunSettings

Every key is typed; an unknown, missing or mistyped key, a value outside its range, or a
layout the contract's rules refuse, is a `ContractError` naming the key or the rule.
`--set section.key=value` overrides any of them.
"""

from __future__ import annotations

import dataclasses
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
    seed: int = 0
    """Seed of the prompts and of every sample's sampling seed."""
    true_on_policy: bool = True
    """Stop the run at the first step whose abs_diff or kl is not 0.0."""
    rollout_path: str = "exact"
    """"exact": the engines run the onpolicy ops; "stock": SGLang's own CPU path (the negative
    control of the assertion: the run must stop at step 1)."""
    verify_weights: bool = True
    """After every sync, check each engine rank's weights against the trainer's by digest."""
    routing_check: bool = True
    """Compare the rollout's routed expert ids with the trainer's at every step."""
    engine_mem_fraction: float = 0.5
    """SGLang's mem_fraction_static. On GPU: the share of memory for weights and KV cache. On
    CPU SGLang sizes the KV cache from free host memory measured before and after loading the
    weights, so this is also the share of that memory other processes starting beside the
    engine (the trainer ranks) may take meanwhile without failing its start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSettings:
    """Where the run writes, how it connects, and which sinks it feeds."""

    out: str = ""
    """Run directory; "" is runs/<config name>."""
    checkpoint_every: int = 0
    """Save the trainer (model and optimizer) every N steps; 0 never."""
    ray_address: str = ""
    """"" starts a local Ray head on bind_address; otherwise ray.init(address=...)."""
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
          "sync": SyncConfig, "run": RunSettings}  # fmt: skip


def _check(e: E2EConfig) -> None:
    g, r = e.grpo, e.run
    positive = {"grpo.steps": g.steps, "grpo.prompts_per_step": g.prompts_per_step,
                "grpo.samples_per_prompt": g.samples_per_prompt,
                "grpo.max_new_tokens": g.max_new_tokens,
                "grpo.micro_batch_tokens": g.micro_batch_tokens}  # fmt: skip
    for key, value in positive.items():
        if value < 1:
            raise ContractError("grpo_config", f"{key} = {value} must be at least 1", f"set {key}")
    if not g.temperature > 0:
        raise ContractError(
            "grpo_config",
            f"grpo.temperature = {g.temperature} must be above 0",
            "sample at a positive temperature (the trainer scores at it)",
        )
    if not 0.0 < g.engine_mem_fraction < 1.0:
        raise ContractError("grpo_config", f"grpo.engine_mem_fraction = {g.engine_mem_fraction}",
                            "set a fraction between 0 and 1")  # fmt: skip
    if g.rollout_path not in ("exact", "stock"):
        raise ContractError("grpo_config", f"grpo.rollout_path = {g.rollout_path!r}",
                            "set it to 'exact' or 'stock'")  # fmt: skip
    if g.rollout_path == "stock" and e.cfg.device != "cpu":
        raise ContractError(
            "grpo_config",
            f"grpo.rollout_path = 'stock' on device {e.cfg.device!r}",
            "the stock control runs on the CPU engine",
        )
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
    e = E2EConfig(cfg=cfg, source=source, **sections)
    _check(e)
    return e


def load_e2e_config(path: str | Path, overrides: dict[str, object] | None = None) -> E2EConfig:
    """Read a GRPO run from a TOML file; `overrides` (dotted keys) win."""
    return e2e_config_from_dict(read_toml(path), overrides, str(path))
