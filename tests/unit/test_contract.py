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
    k_segments,
    load_config,
    resolve_plan,
    validate,
)
from onpolicy.contract.plan import ENV_WHY
from onpolicy.models import QWEN3_30B_A3B
from onpolicy.models import TINY as TINY_SHAPE
from onpolicy.segments import ENV as K_SEGMENTS_ENV
from onpolicy.segments import KSegments

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
    ("expert_k_segments", TINY, {"rollout.ep": 1, "model.tiny.moe_intermediate_size": 48},
     ["pads model.tiny.moe_intermediate_size = 48 to 64", "power of 2 or a multiple of 64"]),
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
]  # fmt: skip

# Rules that an earlier rule pre-empts in `validate`: the shard rules refuse the same layout
# first (a K that a TP does not divide). Each is called alone on its layout, and `validate` is
# shown to refuse that layout too, by the earlier rule.
# (rule, the rule validate names, base config, edits, substrings of the rule's own message)
PRE_EMPTED = [
    ("expert_k_segments", "shard_moe_intermediate", TINY,  # on CUDA: SGLang pads on CPU only
     {"device": "cuda", "training.etp": 2, "rollout.ep": 1,
      "model.tiny.moe_intermediate_size": 33},
     ["training.etp = 2", "model.tiny.moe_intermediate_size = 33 into 2 shards", "S = 1",
      "rollout.tp / rollout.ep = 2 / 1 = 2", "[1]"]),
    ("attention_k_segments", "shard_heads", TINY,
     {"model.tiny.num_attention_heads": 3, "model.tiny.num_key_value_heads": 1,
      "model.tiny.head_dim": 10, "rollout.tp": 4, "rollout.ep": 4},
     ["rollout.tp = 4", "heads x head_dim = 3 x 10 = 30 into 4 shards", "S = 2",
      "training.tp = 2", "[1, 2]"]),
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


@pytest.mark.parametrize(
    ("rule", "first", "base", "edits", "needles"), PRE_EMPTED, ids=[r for r, *_ in PRE_EMPTED]
)
def test_pre_empted_rule_refuses(rule: str, first: str, base: Path, edits: dict,
                                 needles: list[str]) -> None:  # fmt: skip
    cfg = changed(base, **edits)
    with pytest.raises(ContractError) as e:
        RULES[rule](cfg)
    msg = str(e.value)
    assert e.value.rule == rule, msg
    assert msg.startswith(f"[{rule}] ") and "\n  fix: " in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    with pytest.raises(ContractError) as e:
        validate(cfg)
    assert e.value.rule == first, str(e.value)


def test_every_rule_has_a_broken_case() -> None:
    assert set(RULES) == {rule for rule, *_ in BROKEN} | {rule for rule, *_ in PRE_EMPTED}


# Layouts where the two sides cut a row-parallel K differently; both cut it into the run's S
# segments, so both compute the same segment tree. (base, edits, the run's S)
DIFFERENT_CUTS = {
    # Tiny attention K = 4 x 16 = 64, training TP 2, rollout TP 4: S = 4 segments of 16.
    "tiny-rollout-tp4": (TINY, {"rollout.tp": 4, "rollout.ep": 4, "rollout.engines": 1},
                         KSegments(attention=4, experts=1)),
    # Attention K = 24 x 128 = 3072 (24 blocks), rollout TP 4: S = 4 segments of 768 (6 blocks).
    # The old rule (one block tree, shards of it) refused it: 6 blocks are not a subtree.
    "published-heads24-rollout-tp4": (PUBLISHED, {"hf.num_attention_heads": 24, "rollout.tp": 4,
                                                  "rollout.ep": 4, "rollout.engines": 2},
                                      KSegments(attention=4, experts=1)),
    # Tiny expert K = 32 at rollout MoE TP 2 (TP2, EP1) against training ETP 1: S = 2.
    "tiny-moe-tp2": (TINY, {"rollout.ep": 1}, KSegments(attention=2, experts=2)),
    # Expert K = 192 (a 128-block and a 64-wide one) at MoE TP 2: two 96-wide segments. The old
    # rule refused it: a 96-wide shard is not a subtree of that block tree.
    "tiny-expert-k192-moe-tp2": (TINY, {"rollout.ep": 1, "model.tiny.moe_intermediate_size": 192},
                                 KSegments(attention=2, experts=2)),
    # Qwen3-30B-A3B's expert K = 768 (6 blocks) at training ETP 2 against rollout MoE TP 1:
    # S = 2 segments of 384 (3 blocks), one a trainer rank. The old rule refused it.
    "published-etp2": (PUBLISHED, {"training.etp": 2}, KSegments(attention=2, experts=2)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DIFFERENT_CUTS))
def test_the_sides_may_cut_k_differently(case: str) -> None:
    base, edits, want = DIFFERENT_CUTS[case]
    cfg = changed(base, **edits)
    plan = resolve_plan(cfg)
    assert k_segments(cfg) == plan.k_segments == want
    env = f"attention={want.attention},experts={want.experts}"
    assert plan.training_env[K_SEGMENTS_ENV] == plan.rollout_env[K_SEGMENTS_ENV] == env


def test_k_segments_env_round_trips_and_refuses_malformed_values() -> None:
    s = KSegments(attention=4, experts=2)
    assert KSegments.parse(s.env_value()) == s and s.env_value() == "attention=4,experts=2"
    assert KSegments.parse(" experts=1 , attention=8") == KSegments(attention=8, experts=1)
    bad = {
        "attention=2": "experts missing",
        "attention=2,experts=1,attention=2": "'attention=2' is not one of",
        "attention=2,expert=1": "'expert=1' is not one of",
        "attention=two,experts=1": "'attention=two' is not one of",
        "attention=3,experts=1": "attention = 3; S is 1 or a power-of-2 TP",
        "attention=0,experts=1": "attention = 0",
        "": "'' is not one of",
    }
    for text, needle in bad.items():
        with pytest.raises(ValueError) as e:
            KSegments.parse(text)
        assert str(e.value).startswith(f"{K_SEGMENTS_ENV}={text!r}: "), str(e.value)
        assert needle in str(e.value), (text, str(e.value))


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
    # The exact ops and collectives fix their own order: nothing to set for NCCL. Only the K
    # segments: attention K = 32 x 128 = 4096 over TP 2 on both sides; experts whole (MoE TP 1).
    assert plan.training_env == plan.rollout_env == {K_SEGMENTS_ENV: "attention=2,experts=1"}


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
    want = {"ATEN_CPU_CAPABILITY": "avx2", K_SEGMENTS_ENV: "attention=2,experts=1"}
    assert plan.training_env == plan.rollout_env == want
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


def test_stock_processes_run_without_the_exact_paths_pin() -> None:
    """The stock path (the negative controls) takes the plan's environment without the CPU
    capability pin, which only the exact ops need (and which stops stock bf16 SDPA on AVX-512
    hosts); everything else, the K segments included, stays."""
    from onpolicy.contract import stock_env
    from onpolicy.contract.plan import EXACT_ONLY_ENV

    plan = resolve_plan(load_config(TINY))
    base = {"PATH": "/bin", **plan.rollout_env}
    assert stock_env(base) == {"PATH": "/bin", K_SEGMENTS_ENV: "attention=2,experts=1"}
    assert set(EXACT_ONLY_ENV) <= set(plan.rollout_env) <= set(ENV_WHY)
    assert stock_env(base) != base and base["ATEN_CPU_CAPABILITY"] == "avx2"  # not mutated


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
