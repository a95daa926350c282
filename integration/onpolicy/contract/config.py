"""The run config: a typed dataclass tree read from TOML. Unknown or mistyped keys are refused."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

from onpolicy.contract.errors import ContractError


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model: a Hugging Face checkpoint or the seeded tiny model, with the dims that shard."""

    family: str = "qwen3_moe"
    """Model family; the contract covers qwen3_moe only."""
    hf_path: str = ""
    """Hugging Face repo id or local path; empty for the seeded tiny model."""
    dtype: str = "bfloat16"
    """Parameter and activation dtype."""
    num_layers: int
    """Decoder layers (split over PP stages)."""
    hidden_size: int
    """Residual stream width."""
    num_attention_heads: int
    """Query heads (split over TP)."""
    num_kv_heads: int
    """Key/value heads (split over TP, or replicated by SGLang when TP exceeds them)."""
    head_dim: int
    """Width of one attention head; heads x head_dim is the attention output projection's K."""
    num_experts: int
    """Routed experts per MoE layer (split over EP)."""
    top_k: int
    """Experts each token is routed to."""
    moe_intermediate_size: int
    """Expert FFN width (split over expert TP)."""
    vocab_size: int
    """Real vocabulary size (split over TP in the embedding and LM head)."""


@dataclass(kw_only=True, slots=True)
class TrainingLayout:
    """Megatron's parallel layout. DP is what is left of the world after TP, PP and CP."""

    world: int
    """Total trainer ranks."""
    tp: int = 1
    """Tensor parallel size (attention and dense layers)."""
    pp: int = 1
    """Pipeline parallel stages."""
    ep: int = 1
    """Expert parallel size."""
    etp: int = 1
    """Expert tensor parallel size."""
    sp: bool = False
    """Sequence parallel (required with TP > 1 for MoE)."""
    cp: int = 1
    """Context parallel size; the contract pins it to 1."""
    dp: int = 0
    """Data parallel size; 0 derives it as world / (tp * pp * cp)."""


@dataclass(kw_only=True, slots=True)
class RolloutLayout:
    """SGLang's layout: a number of engines, each a TP group with EP inside it."""

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
    training: TrainingLayout
    """The trainer's layout."""
    rollout: RolloutLayout
    """The rollout engines' layout."""


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", str(tp))


def from_dict(cls: type, data: dict, where: str = "") -> object:
    """Build dataclass `cls` from a TOML table; refuse unknown, missing and mistyped keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
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
        if dataclasses.is_dataclass(want):
            if not isinstance(value, dict):
                raise ContractError(
                    "config_types", f"{path!r} must be a table", f"write it as [{path}]"
                )
            kwargs[name] = from_dict(want, value, f"{path}.")
            continue
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise ContractError(
                "config_types",
                f"config key {path!r} is {value!r} ({type(value).__name__}), "
                f"expected {_type_name(want)}",
                f"write {path} as a {_type_name(want)}",
            )
        kwargs[name] = value
    return cls(**kwargs)


def load_config(path: str | Path) -> RunConfig:
    """Read a run config from a TOML file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ContractError(
            "config_file", f"no config file at {p}", "pass --config with an existing file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ContractError("config_file", f"{p} is not valid TOML: {e}", "fix the syntax") from e
    return from_dict(RunConfig, data)
