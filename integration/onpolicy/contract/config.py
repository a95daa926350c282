"""The run config: a typed dataclass tree read from TOML. Unknown or mistyped keys are refused."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from onpolicy.contract.errors import ContractError
from onpolicy.layout import ParallelLayout
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model: an HF checkpoint folder (dims from its config.json) or the seeded tiny one."""

    family: str = "qwen3_moe"
    """Model family; the contract covers qwen3_moe only."""
    dtype: str = "bfloat16"
    """Parameter and activation dtype of the run."""
    hf_path: str = ""
    """An HF checkpoint folder (config.json + *.safetensors); its dims are read from config.json.
    A relative path is taken from the current directory."""
    tiny: dict | None = None
    """The seeded tiny Qwen3-MoE instead of a checkpoint: dims in config.json's names (every
    other dim keeps onpolicy.models.tiny.TINY_DIMS)."""
    seed: int = 0
    """Seed of the tiny model's weights."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """SGLang's side: a number of engines, each a TP group with EP inside it."""

    engines: int
    """Independent SGLang engines."""
    tp: int
    """GPUs (ranks) per engine; SGLang's tp_size."""
    ep: int = 1
    """Expert parallel size inside an engine; MoE TP is tp / ep."""
    dp_attention: bool = False
    """SGLang attention data-parallel; the contract pins it off."""
    colocate: bool = True
    """Engines share the trainer's devices, so engines x tp must equal the training world."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One run: model, device, and the two layouts the contract is checked against."""

    name: str = ""
    """A label for the run."""
    contract: str = "qwen3_moe_true_on_policy_v1"
    """The contract id; only qwen3_moe_true_on_policy_v1 exists."""
    device: str = "cpu"
    """'cpu' (gloo) or 'cuda' (NCCL)."""
    model: ModelConfig
    """The model."""
    training: ParallelLayout
    """The trainer's layout."""
    rollout: RolloutConfig
    """The rollout engines."""
    shape: Qwen3MoeConfig | None = field(default=None, metadata={"derived": True})
    """The model's dims, derived once when the config is read (not a config key)."""


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", str(tp))


def from_dict(cls: type, data: dict, where: str = "") -> object:
    """Build dataclass `cls` from a TOML table; refuse unknown, missing and mistyped keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    for key in data:
        if key not in fields:
            raise ContractError(
                "config_keys",
                f"unknown config key {where + key!r}",
                f"remove it, or use one of the keys of [{where.rstrip('.') or 'top level'}]: "
                f"{', '.join(fields)}",
            )
    kwargs = {}
    for name, f in fields.items():
        path = f"{where}{name}"
        if name not in data:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise ContractError(
                    "config_keys", f"missing config key {path!r}", f"add {path} to the config"
                )
            continue
        value, want = data[name], hints[name]
        if typing.get_origin(want) is typing.Literal:
            if value not in typing.get_args(want):
                choices = ", ".join(repr(a) for a in typing.get_args(want))
                raise ContractError("config_types", f"config key {path!r} is {value!r}",
                                    f"write {path} as one of {choices}")  # fmt: skip
            kwargs[name] = value
            continue
        if dataclasses.is_dataclass(want):
            if not isinstance(value, dict):
                raise ContractError(
                    "config_types", f"{path!r} must be a table", f"write it as [{path}]"
                )
            kwargs[name] = from_dict(want, value, f"{path}.")
            continue
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise ContractError(
                "config_types",
                f"config key {path!r} is {value!r} ({type(value).__name__}), "
                f"expected {_type_name(want)}",
                f"write {path} as a {_type_name(want)}",
            )
        kwargs[name] = value
    return cls(**kwargs)


def model_shape(model: ModelConfig) -> Qwen3MoeConfig:
    """The model's dims: from the checkpoint's config.json, or the tiny model's table."""
    from onpolicy.models.tiny import tiny

    if bool(model.hf_path) == (model.tiny is not None):
        raise ContractError(
            "model_source",
            "the run config must name its model exactly one way; it names "
            + ("both model.hf_path and [model.tiny]" if model.hf_path else "neither"),
            "set model.hf_path to an HF checkpoint folder, or add a [model.tiny] table",
        )
    if model.hf_path:
        path = Path(model.hf_path)
        if not (path / "config.json").is_file():
            raise ContractError(
                "model_source",
                f"model.hf_path = {model.hf_path!r}: no config.json in {path.resolve()}",
                "download the checkpoint there (it holds config.json and *.safetensors) or point "
                "model.hf_path at it (`--set model.hf_path=DIR` on the command line)",
            )
        where = f"{path / 'config.json'}"
        read = lambda: Qwen3MoeConfig.from_hf(path)  # noqa: E731
    else:
        where = "[model.tiny]"
        if "torch_dtype" in model.tiny:
            raise ContractError(
                "model_shape", "[model.tiny] sets torch_dtype", "set model.dtype instead"
            )
        read = lambda: tiny(**model.tiny, torch_dtype=model.dtype)  # noqa: E731
    try:
        return read()
    except (ValueError, TypeError) as e:
        raise ContractError("model_shape", f"{where}: {e}", "fix the model's dims") from e


def model_checkpoint_path(cfg: RunConfig, workdir: str | Path) -> Path:
    """Where `model_checkpoint` finds the model: the config's HF folder, or the seeded tiny
    checkpoint's folder under `workdir` (named by shape and seed), written or not."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    import hashlib

    key = hashlib.sha256(repr((cfg.shape, cfg.model.seed)).encode()).hexdigest()[:12]
    return Path(workdir) / f"tiny-seed{cfg.model.seed}-{key}"


def model_checkpoint(cfg: RunConfig, workdir: str | Path) -> Path:
    """The config's HF folder, or the seeded tiny checkpoint under `workdir`, written once per
    shape and seed."""
    out = model_checkpoint_path(cfg, workdir)
    if cfg.model.hf_path:
        return out
    from onpolicy.models.tiny import DONE, write_tiny_checkpoint

    if not (out / DONE).is_file():
        write_tiny_checkpoint(out, cfg.shape, seed=cfg.model.seed)
    return out


def _set_dotted(data: dict, key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        data = data.setdefault(p, {})
        if not isinstance(data, dict):
            raise ContractError("config_override", f"--set {key}: {p!r} is not a table", "")
    data[leaf] = value


def parse_override(item: str) -> tuple[str, object]:
    """`key.path=value` with a TOML value (`tp=2`, `sp=true`); anything else is a string."""
    key, eq, raw = item.partition("=")
    if not eq or not key.strip():
        raise ContractError(
            "config_override", f"--set {item!r} is not KEY=VALUE", "write e.g. training.tp=2"
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


LOOP_SECTIONS = ("grpo", "loss", "optimizer", "sync", "task", "data", "reward", "eval", "run")
"""Tables of a run config that only the GRPO loop reads (`onpolicy.grpo.config`, which checks
their keys); no rule of the contract depends on them."""


def apply_overrides(data: dict, overrides: dict[str, object] | None) -> dict:
    """A deep copy of TOML data with dotted-key overrides applied (they win)."""
    import copy

    data = copy.deepcopy(data)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    return data


def config_from_dict(data: dict, overrides: dict[str, object] | None = None) -> RunConfig:
    """A run config from TOML data, with dotted-key overrides applied first (they win)."""
    data = apply_overrides(data, overrides)
    data = {k: v for k, v in data.items() if k not in LOOP_SECTIONS}
    cfg = from_dict(RunConfig, data)
    cfg.shape = model_shape(cfg.model)
    return cfg


def load_config(path: str | Path, overrides: dict[str, object] | None = None) -> RunConfig:
    """Read a run config from a TOML file; `overrides` (dotted keys) take precedence."""
    return config_from_dict(read_toml(path), overrides)


def read_toml(path: str | Path) -> dict:
    """A config file's TOML data; a missing file or bad syntax is a ContractError."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ContractError(
            "config_file", f"no config file at {p}", "pass --config with an existing file"
        ) from None
    except IsADirectoryError:
        raise ContractError("config_file", f"{p} is a directory",
                            "pass --config with a TOML file") from None  # fmt: skip
    except OSError as e:
        raise ContractError("config_file", f"{p} cannot be read: {e.strerror or e}",
                            "pass --config with a readable TOML file") from None  # fmt: skip
    except UnicodeDecodeError as e:
        raise ContractError("config_file", f"{p} is not UTF-8 text (byte {e.start})",
                            "pass --config with a TOML file") from None  # fmt: skip
    except RecursionError:
        raise ContractError("config_file", f"{p} nests its tables or arrays too deeply to read",
                            "flatten it") from None  # fmt: skip
    except tomllib.TOMLDecodeError as e:
        raise ContractError("config_file", f"{p} is not valid TOML: {e}", "fix the syntax") from e
    return data
