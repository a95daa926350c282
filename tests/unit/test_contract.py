"""qwen3_moe_true_on_policy_v1: each topology rule refuses one broken layout with a readable
message (rule, values, fix), the shipped configs pass, and the config loader refuses bad keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from onpolicy.contract import (
    QWEN3_MOE_TRUE_ON_POLICY_V1,
    RULES,
    ContractError,
    RunConfig,
    load_config,
    resolve_plan,
    validate,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"
PUBLISHED = CONFIGS / "qwen3-30b-a3b-tp2pp2ep2-sp.toml"


def changed(path: Path, **edits: object) -> RunConfig:
    """The config at `path` with dotted-key edits, e.g. changed(TINY, **{"training.sp": False})."""
    cfg = load_config(path)
    for key, value in edits.items():
        *parents, leaf = key.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg


# (rule, base config, edits, substrings the message must contain: the values and the fix)
BROKEN = [
    ("contract_name", TINY, {"contract": "qwen3_moe_v0"}, ["'qwen3_moe_v0'"]),
    ("model_family", TINY, {"model.family": "qwen2_moe"}, ["'qwen2_moe'", "'qwen3_moe'"]),
    ("dtype", TINY, {"model.dtype": "float16"}, ["'float16'", "'bfloat16'"]),
    ("device", TINY, {"device": "tpu"}, ["'tpu'"]),
    ("allowed_dims", TINY, {"training.cp": 2}, ["training.cp = 2", "set training.cp = 1"]),
    ("allowed_dims", TINY, {"rollout.dp_attention": True}, ["rollout.dp_attention = true"]),
    ("positive_sizes", TINY, {"rollout.engines": 0}, ["rollout.engines = 0"]),
    ("positive_sizes", TINY, {"model.top_k": 9}, ["model.top_k = 9", "num_experts = 8"]),
    ("world_layout", TINY, {"training.world": 5}, ["training.world = 5", "2 x 1 x 1 = 2"]),
    ("world_layout", TINY, {"training.dp": 4}, ["training.dp = 4", "set training.dp = 2"]),
    ("power_of_2_groups", TINY, {"training.ep": 3}, ["training.ep = 3", "to 2 or 4"]),
    ("power_of_2_groups", TINY, {"training.world": 6}, ["training.dp = 3"]),
    ("power_of_2_groups", TINY, {"rollout.tp": 6, "rollout.ep": 6}, ["rollout.tp = 6"]),
    ("sp_required", TINY, {"training.sp": False}, ["training.tp = 2", "training.sp = true"]),
    ("ep_divides_dp", TINY, {"training.ep": 4}, ["training.ep = 4", "= 2"]),
    ("rollout_ep_divides_tp", TINY, {"rollout.ep": 4}, ["rollout.ep = 4", "rollout.tp = 2"]),
    ("rollout_moe_tp_equals_etp", TINY, {"rollout.ep": 1},
     ["2 / 1 = 2", "training.etp = 1", "set rollout.ep = 2"]),
    ("rollout_moe_tp_equals_etp", PUBLISHED, {"training.etp": 2},
     ["2 / 2 = 1", "training.etp = 2", "set rollout.ep = 1"]),
    ("colocated_gpus", TINY, {"rollout.engines": 3}, ["3 x 2 = 6", "training.world = 4"]),
    ("pp_divides_layers", PUBLISHED, {"model.num_layers": 47},
     ["model.num_layers = 47", "training.pp = 2"]),
    ("shard_heads", PUBLISHED, {"model.num_attention_heads": 31},
     ["model.num_attention_heads = 31", "training.tp = 2"]),
    ("shard_kv_heads", TINY, {"model.num_kv_heads": 1}, ["model.num_kv_heads = 1", "tp = 2"]),
    ("shard_kv_heads", PUBLISHED,
     {"model.num_kv_heads": 6, "rollout.tp": 4, "rollout.ep": 4, "rollout.engines": 2},
     ["model.num_kv_heads = 6", "rollout.tp = 4"]),
    ("shard_experts", TINY, {"model.num_experts": 7}, ["model.num_experts = 7", "ep = 2"]),
    ("shard_moe_intermediate", TINY,
     {"training.etp": 2, "rollout.ep": 1, "model.moe_intermediate_size": 33},
     ["model.moe_intermediate_size = 33", "training.etp = 2"]),
    ("shard_vocab", TINY, {"model.vocab_size": 1001}, ["model.vocab_size = 1001", "tp = 2"]),
    ("rollout_tp_tree_exact", PUBLISHED,
     {"model.num_attention_heads": 24, "rollout.tp": 4, "rollout.ep": 4, "rollout.engines": 2},
     ["rollout.tp = 4", "training.tp = 2", "K = heads x head_dim = 3072", "128"]),
]  # fmt: skip


@pytest.mark.parametrize("path", [TINY, PUBLISHED], ids=["tiny-cpu", "published"])
def test_shipped_configs_are_valid(path: Path) -> None:
    validate(load_config(path))


@pytest.mark.parametrize(
    ("rule", "base", "edits", "needles"),
    BROKEN,
    ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BROKEN)],
)
def test_rule_refuses(rule: str, base: Path, edits: dict, needles: list[str]) -> None:
    with pytest.raises(ContractError) as e:
        validate(changed(base, **edits))
    msg = str(e.value)
    assert e.value.rule == rule, msg
    assert msg.startswith(f"[{rule}] ") and "\n  fix: " in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_every_rule_has_a_broken_case() -> None:
    assert set(RULES) == {rule for rule, *_ in BROKEN}


def test_rollout_tp_may_differ_where_the_tree_keeps_it_exact() -> None:
    # Tiny attention K = 4 x 16 = 64: TP2 and TP4 cut it into 32 and 16 wide power-of-2 slices
    # of the one block, both aligned subtrees, so the rollout may use TP4 against training TP2.
    cfg = changed(TINY, **{"rollout.tp": 4, "rollout.ep": 4, "rollout.engines": 1})
    plan = resolve_plan(cfg)
    assert plan.gpus_per_engine == 4 and plan.rollout_dims["moe_tp"] == 1


def test_published_plan_layout() -> None:
    plan = resolve_plan(load_config(PUBLISHED))
    assert (plan.engines, plan.gpus_per_engine) == (4, 2)
    assert plan.training_dims == {
        "tp": 2,
        "pp": 2,
        "ep": 2,
        "etp": 1,
        "sp": True,
        "dp": 2,
        "edp": 2,
    }
    coords = [(r.tp, r.dp, r.pp, r.ep, r.layers, r.experts) for r in plan.training_ranks]
    assert coords[0] == (0, 0, 0, 0, (0, 24), (0, 64))
    assert coords[1] == (1, 0, 0, 1, (0, 24), (64, 128))
    assert coords[2] == (0, 1, 0, 0, (0, 24), (0, 64))
    assert coords[7] == (1, 1, 1, 1, (24, 48), (64, 128))
    assert [(r.engine, r.device, r.moe_ep) for r in plan.rollout_ranks[:3]] == [
        (0, 0, 0), (0, 1, 1), (1, 2, 0),
    ]  # fmt: skip
    assert "--sequence-parallel" in plan.megatron_args
    assert plan.sglang_args["tp_size"] == 2 and plan.sglang_args["ep_size"] == 2
    assert plan.rollout_env["NCCL_ALGO"] == "Ring"


def test_schema_names_the_contract() -> None:
    c = QWEN3_MOE_TRUE_ON_POLICY_V1
    assert (c.name, c.model_family, c.logprob.name) == (
        "qwen3_moe_true_on_policy_v1",
        "qwen3_moe",
        "sglang_prefill",
    )
    assert c.kernels.matmul == "tree_k128" and c.kernels.moe_combine == "expert_id_tree"
    assert set(c.training_dims) == {"tp", "pp", "ep", "etp", "sp", "dp"}
    assert dataclasses.is_dataclass(c)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


TINY_TEXT = TINY.read_text()


@pytest.mark.parametrize(
    ("text", "rule", "needles"),
    [
        (
            TINY_TEXT.replace("sp = true", "sp = true\nspp = 1"),
            "config_keys",
            ["'training.spp'", "world, tp, pp"],
        ),
        (
            TINY_TEXT.replace('device = "cpu"', 'device = "cpu"\ngpus = 8'),
            "config_keys",
            ["'gpus'", "top level"],
        ),
        (TINY_TEXT.replace("engines = 2\n", ""), "config_keys", ["'rollout.engines'"]),
        (TINY_TEXT.replace("sp = true", "sp = 1"), "config_types", ["'training.sp'", "bool"]),
        (
            TINY_TEXT.replace("tp = 2\npp", "tp = true\npp"),
            "config_types",
            ["'training.tp'", "int"],
        ),
        (TINY_TEXT.replace("world = 4", 'world = "4"'), "config_types", ["'training.world'"]),
        (
            "rollout = 3\n" + TINY_TEXT.split("[rollout]")[0],
            "config_types",
            ["'rollout' must be a table"],
        ),
        (TINY_TEXT + "\n[training\n", "config_file", ["not valid TOML"]),
    ],
    ids=[
        "unknown-nested",
        "unknown-top",
        "missing",
        "bool-for-int",
        "int-for-bool",
        "str-for-int",
        "table",
        "syntax",
    ],
)
def test_config_loader_refuses(tmp_path: Path, text: str, rule: str, needles: list[str]) -> None:
    with pytest.raises(ContractError) as e:
        load_config(_write(tmp_path, text))
    assert e.value.rule == rule, str(e.value)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in {str(e.value)!r}"


def test_config_loader_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"\[config_file\] no config file"):
        load_config(tmp_path / "nope.toml")
