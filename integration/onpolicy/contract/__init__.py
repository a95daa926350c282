"""qwen3_moe_true_on_policy_v1: the schema, the run config, the topology rules and the plan.

`load_config(path)` reads a TOML run config; `validate(cfg)` raises the first failing rule's
`ContractError`; `k_segments(cfg)` gives S of each row-parallel matmul; `resolve_plan(cfg)`
validates and derives engines, per-rank layout, K segments, engine arguments and environment.
`onpolicy validate --config FILE` prints that plan.
"""

from onpolicy.contract.config import (
    ModelConfig,
    RolloutConfig,
    RunConfig,
    config_from_dict,
    from_dict,
    load_config,
    model_checkpoint,
    model_checkpoint_path,
    model_shape,
    parse_override,
)
from onpolicy.contract.errors import ContractError
from onpolicy.contract.plan import Plan, format_plan, plan_dict, resolve_plan, stock_env
from onpolicy.contract.rules import RULES, k_segments, validate
from onpolicy.contract.schema import QWEN3_MOE_TRUE_ON_POLICY_V1, Contract

__all__ = [
    "QWEN3_MOE_TRUE_ON_POLICY_V1",
    "RULES",
    "Contract",
    "ContractError",
    "ModelConfig",
    "Plan",
    "RolloutConfig",
    "RunConfig",
    "config_from_dict",
    "format_plan",
    "from_dict",
    "k_segments",
    "load_config",
    "model_checkpoint",
    "model_checkpoint_path",
    "model_shape",
    "parse_override",
    "plan_dict",
    "resolve_plan",
    "stock_env",
    "validate",
]
