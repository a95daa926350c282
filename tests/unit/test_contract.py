"""qwen3_moe_true_on_policy_v1: each topology rule refuses one broken layout with a readable
message (rule, values, fix), the shipped configs pass, and the config loader refuses bad keys."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from onpolicy.contract import (
    QWEN3_MOE_TRUE_ON_POLICY_V1,
    RULES,
    ContractError,
    RunConfig,
    config_from_dict,
    load_config,
    resolve_plan,
    validate,
)
from onpolicy.contract.plan import ENV_WHY
from onpolicy.models import QWEN3_30B_A3B
from onpolicy.models import TINY as TINY_SHAPE

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"
PUBLISHED = CONFIGS / "qwen3-30b-a3b-tp2pp2ep2-sp.toml"


def changed(path: Path, **edits: object) -> RunConfig:
    """The config at `path` with dotted-key overrides, e.g. changed(TINY, **{"training.sp":
    False}). A config that names an HF checkpoint gets a folder holding the published
    Qwen3-30B-A3B config.json, with `hf.<field>` edits applied to that file."""
    data = tomllib.loads(path.read_text())
    overrides = {k: v for k, v in edits.items() if not k.startswith("hf.")}
    if "hf_path" in data["model"]:
        folder = Path(tempfile.mkdtemp(prefix="hf-config-"))
        hf = {**QWEN3_30B_A3B.to_hf(), **{k[3:]: v for k, v in edits.items() if k[:3] == "hf."}}
        (folder / "config.json").write_text(json.dumps(hf))
        overrides.setdefault("model.hf_path", str(folder))
    return config_from_dict(data, overrides)


# (rule, base config, edits, substrings the message must contain: the values and the fix)
BROKEN = [
    ("contract_name", TINY, {"contract": "qwen3_moe_v0"}, ["'qwen3_moe_v0'"]),
    ("model_family", TINY, {"model.family": "qwen2_moe"}, ["'qwen2_moe'", "'qwen3_moe'"]),
    ("dtype", TINY, {"model.dtype": "float16"}, ["'float16'", "'bfloat16'"]),
    ("device", TINY, {"device": "tpu"}, ["'tpu'"]),
    ("allowed_dims", TINY, {"training.cp": 2},
     ["training.cp = 2", "pins it to 1", "context parallel", "set training.cp = 1"]),
    ("allowed_dims", TINY, {"rollout.dp_attention": True},
     ["rollout.dp_attention = true", "set rollout.dp_attention = false"]),
    ("positive_sizes", TINY, {"rollout.engines": 0}, ["rollout.engines = 0"]),
    ("world_layout", TINY, {"training.world": 5}, ["training.world = 5", "2 x 2 x 1 = 4"]),
    ("world_layout", TINY, {"training.dp": 4}, ["training.dp = 4", "set training.dp = 2"]),
    ("power_of_2_groups", TINY, {"training.ep": 3}, ["training.ep = 3", "to 2 or 4"]),
    ("power_of_2_groups", TINY, {"training.world": 12}, ["training.dp = 3"]),
    ("power_of_2_groups", TINY, {"rollout.tp": 6, "rollout.ep": 6}, ["rollout.tp = 6"]),
    ("sp_required", TINY, {"training.sp": False}, ["training.tp = 2", "training.sp = true"]),
    ("ep_divides_dp", TINY, {"training.ep": 4}, ["training.ep = 4", "= 2"]),
    ("rollout_ep_divides_tp", TINY, {"rollout.ep": 4}, ["rollout.ep = 4", "rollout.tp = 2"]),
    ("rollout_moe_tp_tree_exact", TINY, {"rollout.ep": 1, "model.tiny.moe_intermediate_size": 48},
     ["2 / 1 = 2", "training.etp = 1", "model.tiny.moe_intermediate_size = 48", "shards of 24",
      "set rollout.ep = 2"]),
    ("rollout_moe_tp_tree_exact", PUBLISHED, {"training.etp": 2},
     ["2 / 2 = 1", "training.etp = 2", "shards of 384", "set rollout.ep = 1"]),
    ("colocated_gpus", TINY, {"rollout.engines": 3, "rollout.colocate": True},
     ["3 x 2 = 6", "training.world = 8"]),
    ("pp_divides_layers", PUBLISHED, {"hf.num_hidden_layers": 47},
     ["num_hidden_layers (config.json of model.hf_path) = 47", "training.pp = 2"]),
    ("pp_divides_layers", TINY, {"model.tiny.num_hidden_layers": 3, "training.pp": 2,
                                 "training.world": 8, "rollout.engines": 4},
     ["model.tiny.num_hidden_layers = 3", "training.pp = 2"]),
    ("shard_heads", PUBLISHED, {"hf.num_attention_heads": 35, "hf.num_key_value_heads": 5},
     ["num_attention_heads (config.json of model.hf_path) = 35", "training.tp = 2"]),
    ("shard_kv_heads", TINY, {"model.tiny.num_key_value_heads": 1},
     ["model.tiny.num_key_value_heads = 1", "tp = 2"]),
    ("shard_kv_heads", PUBLISHED,
     {"hf.num_attention_heads": 48, "hf.num_key_value_heads": 6, "rollout.tp": 4,
      "rollout.ep": 4, "rollout.engines": 2},
     ["num_key_value_heads (config.json of model.hf_path) = 6", "rollout.tp = 4"]),
    ("shard_experts", TINY, {"model.tiny.num_experts": 7},
     ["model.tiny.num_experts = 7", "ep = 2"]),
    ("shard_moe_intermediate", TINY,
     {"training.etp": 2, "rollout.ep": 1, "model.tiny.moe_intermediate_size": 33},
     ["model.tiny.moe_intermediate_size = 33", "training.etp = 2"]),
    ("shard_vocab", TINY, {"model.tiny.vocab_size": 1001},
     ["model.tiny.vocab_size = 1001", "tp = 2"]),
    ("vocab_parallel_exact", PUBLISHED,
     {"rollout.tp": 16, "rollout.ep": 16, "rollout.colocate": False},
     ["rollout.tp = 16", "151936", "8 equal segments", "set rollout.tp to one of [1, 2, 4, 8]"]),
    ("rollout_tp_tree_exact", PUBLISHED,
     {"hf.num_attention_heads": 24, "rollout.tp": 4, "rollout.ep": 4, "rollout.engines": 2},
     ["rollout.tp = 4", "training.tp = 2", "K = heads x head_dim = 3072", "128"]),
]  # fmt: skip

# Refused while the config is read, before any rule: how the model is named, and its dims.
BROKEN_MODEL = [
    ("model_source", TINY, {"model.hf_path": "/some/ckpt"},
     ["both model.hf_path and [model.tiny]"]),
    ("model_source", PUBLISHED, {"model.hf_path": "/nonexistent/Qwen3-30B-A3B"},
     ["no config.json in /nonexistent/Qwen3-30B-A3B", "--set model.hf_path=DIR"]),
    ("model_shape", TINY, {"model.tiny.num_experts_per_tok": 9},
     ["[model.tiny]", "num_experts_per_tok = 9 exceeds num_experts = 8"]),
    ("model_shape", TINY, {"model.tiny.hidden": 64}, ["unknown dims ['hidden']"]),
    ("model_shape", TINY, {"model.tiny.torch_dtype": "float32"}, ["set model.dtype instead"]),
    ("model_shape", PUBLISHED, {"hf.num_attention_heads": 31},
     ["config.json", "num_attention_heads = 31 is not a multiple of num_key_value_heads = 4"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "base", "edits", "needles"),
    BROKEN_MODEL,
    ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BROKEN_MODEL)],
)
def test_model_refused_while_reading(rule: str, base: Path, edits: dict, needles: list[str]):
    with pytest.raises(ContractError) as e:
        changed(base, **edits)
    msg = str(e.value)
    assert e.value.rule == rule, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_model_named_neither_way_is_refused():
    data = tomllib.loads(TINY.read_text())
    del data["model"]["tiny"]
    with pytest.raises(ContractError, match="names neither"):
        config_from_dict(data)


def test_dims_are_read_once_from_their_one_source():
    tiny = load_config(TINY)
    assert tiny.shape == TINY_SHAPE  # the tiny table spells the default tiny model
    published = changed(PUBLISHED)
    assert published.shape == QWEN3_30B_A3B
    assert changed(PUBLISHED, **{"hf.num_experts": 64}).shape.num_experts == 64


@pytest.mark.parametrize("path", [TINY, PUBLISHED], ids=["tiny-cpu", "published"])
def test_shipped_configs_are_valid(path: Path) -> None:
    validate(changed(path))


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


def test_rollout_moe_tp_may_differ_from_etp_where_the_tree_keeps_it_exact() -> None:
    # Tiny expert K = 32: rollout MoE TP 2 (TP2, EP1) cuts it into 16-wide power-of-2 slices of
    # the one block, an aligned subtree, so it agrees with training ETP 1 (the whole tree).
    cfg = changed(TINY, **{"rollout.ep": 1})
    plan = resolve_plan(cfg)
    assert plan.rollout_dims["moe_tp"] == 2 and cfg.training.etp == 1


def test_published_plan_layout() -> None:
    plan = resolve_plan(changed(PUBLISHED))
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
    coords = [tuple(r[k] for k in ("tp", "dp", "pp", "ep", "layers", "experts"))
              for r in plan.training_ranks]  # fmt: skip
    assert coords[0] == (0, 0, 0, 0, (0, 24), (0, 64))
    assert coords[1] == (1, 0, 0, 1, (0, 24), (64, 128))
    assert coords[2] == (0, 1, 0, 0, (0, 24), (0, 64))
    assert coords[7] == (1, 1, 1, 1, (24, 48), (64, 128))
    assert [(r["engine"], r["device"], r["moe_ep"]) for r in plan.rollout_ranks[:3]] == [
        (0, 0, 0), (0, 1, 1), (1, 2, 0),
    ]  # fmt: skip
    assert "--sequence-parallel" in plan.megatron_args
    assert plan.sglang_args["tp_size"] == 2 and plan.sglang_args["ep_size"] == 2
    # The exact ops and collectives fix their own order: nothing to set for NCCL.
    assert plan.training_env == plan.rollout_env == {}


def test_schema_fields_drive_the_rules() -> None:
    c = QWEN3_MOE_TRUE_ON_POLICY_V1
    assert (c.name, c.model_family, c.param_dtype) == ("qwen3_moe_true_on_policy_v1",
                                                       "qwen3_moe", "bfloat16")  # fmt: skip
    # Every pinned dim is refused by allowed_dims when moved, naming the contract's reason.
    for path, value, why in c.fixed_dims:
        moved = (not value) if isinstance(value, bool) else value + 1
        with pytest.raises(ContractError) as e:
            validate(changed(TINY, **{path: moved}))
        assert e.value.rule == "allowed_dims" and why in str(e.value)


def test_plan_environment_is_explained_and_needed(tmp_path: Path) -> None:
    """Each variable the plan sets has a reason, and the CPU one is needed: torch's DEFAULT
    vector level gives other bits than AVX2 for the same exact ops (measured in subprocesses,
    since the level is fixed when torch loads)."""
    plan = resolve_plan(load_config(TINY))
    assert plan.training_env == plan.rollout_env == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert set(plan.training_env) <= set(ENV_WHY)
    script = tmp_path / "ops.py"
    script.write_text(
        "import hashlib, torch\n"
        "from onpolicy import kernels as K\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(64, 1024, generator=g) * 4\n"
        "outs = [K.log_softmax(x), K.silu_mul(x, x), K.rms_norm(x, torch.ones(1024), 1e-6)]\n"
        "print(hashlib.sha256(b''.join(o.view(torch.int32).numpy().tobytes() for o in outs))"
        ".hexdigest())\n"
    )
    root = Path(__file__).resolve().parents[2]

    def digest(level: str) -> str:
        env = {"ATEN_CPU_CAPABILITY": level, "PYTHONPATH": str(root / "integration")}
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=120, check=True)  # fmt: skip
        return p.stdout.strip()

    assert digest("avx2") == digest("avx2")
    assert digest("default") != digest("avx2")


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
        (TINY_TEXT.replace("world = 8", 'world = "8"'), "config_types", ["'training.world'"]),
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
