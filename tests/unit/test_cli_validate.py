"""`onpolicy validate --config FILE`: the plan for a valid config, exit 2 with the rule otherwise;
`onpolicy upstream` still dispatches to the patch-series tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onpolicy.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
PUBLISHED = REPO / "configs" / "qwen3-30b-a3b-tp2pp2ep2-sp.toml"


def test_tiny_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--config", str(TINY)]) == 0
    out = capsys.readouterr().out
    for needle in [
        "qwen3_moe_true_on_policy_v1  (valid)",
        "training  world 8: TP2 PP2 EP2 ETP1 SP DP2 EDP2",
        "rollout   2 engines x 2 CPU ranks per engine: TP2 EP2 MOE_TP1",
        "training ranks",
        "rollout ranks",
        "megatron args  --tensor-model-parallel-size 2",
        "--distributed-backend gloo",
        "sglang args    Engine(tp_size=2, ep_size=2",
        "training env   ATEN_CPU_CAPABILITY=avx2",
        "rollout env    ATEN_CPU_CAPABILITY=avx2",
        "  ATEN_CPU_CAPABILITY: torch's CPU vector kernels",
        "model     tiny (seed 0): 4 layers, hidden 64",
    ]:
        assert needle in out, f"{needle!r} not in:\n{out}"
    rank_lines = out.split("training ranks")[1].split("rollout ranks")[0].strip().splitlines()
    assert len(rank_lines) == 1 + 8  # header + one line per trainer rank


@pytest.fixture
def published_checkpoint(tmp_path: Path) -> Path:
    """A folder holding only the published Qwen3-30B-A3B config.json: all validate reads."""
    from onpolicy.models import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B.to_hf()))
    return tmp_path


def test_published_plan_json(published_checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    hf = f"model.hf_path={published_checkpoint}"
    assert main(["validate", "--config", str(PUBLISHED), "--set", hf, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["engines"], plan["gpus_per_engine"], plan["backend"]) == (4, 2, "nccl")
    assert len(plan["training_ranks"]) == len(plan["rollout_ranks"]) == 8
    # On CUDA only the run's K segments (attention K 4096 over TP 2, the experts whole).
    assert plan["rollout_env"] == {"ONPOLICY_K_SEGMENTS": "attention=2,experts=1"}
    assert plan["k_segments"] == {"attention": 2, "experts": 1}
    assert "--sequence-parallel" in plan["megatron_args"]


def test_published_config_without_its_checkpoint_names_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = "model.hf_path=/nonexistent/ckpt"
    assert main(["validate", "--config", str(PUBLISHED), "--set", bad]) == 2
    err = capsys.readouterr().err
    assert "[model_source] model.hf_path = '/nonexistent/ckpt': no config.json" in err


def test_overrides_win_over_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["validate", "--config", str(TINY), "--set", "training.world=16",
            "--set", "rollout.engines=4", "--set", "model.tiny.num_experts=16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "training  world 16: TP2 PP2 EP2 ETP1 SP DP4" in out and "16 experts top-2" in out
    assert main(["validate", "--config", str(TINY), "--set", "training.tp"]) == 2
    assert "[config_override] --set 'training.tp' is not KEY=VALUE" in capsys.readouterr().err


def test_broken_config_exits_2_with_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("sp = true", "sp = false"))
    assert main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "[sp_required] training.tp = 2" in err and "fix: set training.sp = true" in err


def test_unknown_key_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("[rollout]", "[rollout]\nengine = 2"))
    assert main(["validate", "--config", str(bad)]) == 2
    assert "unknown config key 'rollout.engine'" in capsys.readouterr().err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--config", str(tmp_path / "none.toml")]) == 2
    assert "[config_file]" in capsys.readouterr().err


def test_unreadable_configs_exit_2_naming_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 8)
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    for path, what in ((tmp_path, "is a directory"), (binary, "is not UTF-8 text"),
                       (deep, "nests its tables or arrays too deeply")):  # fmt: skip
        assert main(["validate", "--config", str(path)]) == 2, path
        err = capsys.readouterr().err
        assert "[config_file]" in err and what in err and "Traceback" not in err, err


def test_the_loop_tables_are_checked_as_e2e_checks_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("temperature = 1.0", "temprature = 1.0"))
    assert main(["validate", "--config", str(bad)]) == 2
    assert "unknown config key 'grpo.temprature'" in capsys.readouterr().err
    for key, value, rule, what in (
        ("optimizer.lr", "-1e-3", "optimizer_config", "lr must be finite and above 0, got -0.001"),
        ("optimizer.clip_grad", "-1.0", "optimizer_config", "clip_grad must be finite and >= 0"),
        ("optimizer.adam_beta2", "1.0", "optimizer_config", "adam_beta2 must be in [0, 1)"),
        ("run.actor_timeout_s", "0", "run_config", "run.actor_timeout_s = 0"),
        ("run.start_timeout_s", "-1", "run_config", "run.start_timeout_s = -1"),
        ("loss.eps_clip_low", "1.5", "loss_config", "eps_clip_low must be in [0, 1)"),
        ("grpo.temperature", "0.0", "grpo_config", "grpo.temperature = 0.0 must be finite"),
    ):  # fmt: skip
        assert main(["validate", "--config", str(TINY), "--set", f"{key}={value}"]) == 2, key
        err = capsys.readouterr().err
        assert f"[{rule}]" in err and what in err, err


def test_usage_and_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "onpolicy validate --config FILE [--set KEY=VALUE ...]" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert "known: upstream, validate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["upstream", "--help"])
    assert e.value.code == 0
    assert "usage: onpolicy upstream" in capsys.readouterr().out


def test_command_line_exit_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("ep = 2\netp", "ep = 3\netp"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "integration")}
    cmd = [sys.executable, "-m", "onpolicy.cli", "validate", "--config", str(bad)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "[power_of_2_groups] training.ep = 3" in p.stderr
