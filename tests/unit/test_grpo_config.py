"""The GRPO run's config (`onpolicy.grpo.config`) and the driver's per-step log-prob metrics."""

from __future__ import annotations

import dataclasses
import struct
import tomllib
from pathlib import Path

import pytest
import torch
from onpolicy.compare import logprob_metrics
from onpolicy.contract import ContractError, load_config
from onpolicy.grpo.config import e2e_config_from_dict, load_e2e_config
from onpolicy.grpo.e2e import format_table, main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
MATH = REPO / "configs" / "tiny-cpu-math.toml"
PUBLISHED = REPO / "configs" / "qwen3-30b-a3b-tp2pp2ep2-sp.toml"


def test_tiny_config_is_the_published_shape_scaled_down():
    e = load_e2e_config(TINY)
    t = e.cfg.training
    assert (t.world, t.tp, t.pp, t.ep, t.etp, t.sp) == (8, 2, 2, 2, 1, True)
    assert (e.cfg.rollout.tp, e.cfg.rollout.ep) == (2, 2)
    assert e.grpo.true_on_policy and e.grpo.steps >= 2
    assert e.run.bind_address == "127.0.0.1" and e.sync.backend == "gloo"
    assert str(e.out_dir) == "runs/tiny-cpu"


def test_published_recipe_reads_its_loop_tables(tmp_path):
    import json

    from onpolicy.models import QWEN3_30B_A3B

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B.to_hf()))
    e = load_e2e_config(PUBLISHED, {"model.hf_path": str(tmp_path)})
    assert e.cfg.device == "cuda" and e.sync.backend == "nccl" and e.cfg.rollout.engines == 4
    assert e.loss.eps_clip_high == 0.28


def test_resolved_config_round_trips():
    e = load_e2e_config(TINY, {"grpo.steps": 5, "loss.kl_coef": 0.01})
    again = e2e_config_from_dict(e.to_dict())
    assert again.to_dict() == e.to_dict()
    assert again.grpo.steps == 5 and again.loss.kl_coef == 0.01


def test_the_weight_sync_rendezvous_listens_on_the_bind_address():
    """The sync group's store binds run.bind_address: set once, not kept in two keys."""
    for bind in ("::1", "localhost"):
        e = load_e2e_config(TINY, {"run.bind_address": bind})
        assert e.sync.address == bind, e.sync
    e = load_e2e_config(TINY, {"run.bind_address": "::1", "sync.address": "::1"})
    assert e.sync.address == "::1"


def test_the_contract_ignores_the_loop_tables_but_the_loop_checks_them():
    load_config(TINY)  # [grpo] and the rest are not the contract's keys, and not refused there
    with pytest.raises(ContractError, match=r"unknown config key 'grpo\.stepz'") as e:
        load_e2e_config(TINY, {"grpo.stepz": 3})
    assert e.value.rule == "config_keys"


@pytest.mark.parametrize(
    ("overrides", "rule", "needles"),
    [
        ({"grpo.steps": 0}, "grpo_config", ["grpo.steps = 0"]),
        ({"grpo.samples_per_prompt": 0}, "grpo_config", ["grpo.samples_per_prompt = 0"]),
        ({"grpo.temperature": 0.0}, "grpo_config", ["grpo.temperature = 0.0"]),
        ({"grpo.rollout_path": "fast"}, "grpo_config", ["'fast'", "'exact' or 'stock'"]),
        ({"grpo.compile_warmup": "yes"}, "grpo_config", ["'yes'", "'cuda', 'always' or 'never'"]),
        ({"grpo.steps": "two"}, "config_types", ["'grpo.steps'", "int"]),
        ({"loss.kl_estimator": "k4"}, "config_types", ["'loss.kl_estimator'", "'k3'"]),
        ({"loss.eps_clip_low": 1.5}, "loss_config", ["eps_clip_low", "1.5"]),
        ({"sync.transport": "carrier-pigeon"}, "sync_config", ["carrier-pigeon"]),
        ({"sync.transport": "tensor"}, "sync_config", ["rollout.colocate = true"]),
        ({"sync.backend": "nccl"}, "sync_config", ["'nccl'", "'cpu'", "set sync.backend = 'gloo'"]),
        ({"run.checkpoint_every": -1}, "run_config", ["run.checkpoint_every = -1"]),
        ({"run.wandb_mode": "loud"}, "run_config", ["'loud'"]),
        ({"run.bind_address": ""}, "run_config", ["run.bind_address is empty"]),
        (
            {"sync.address": "0.0.0.0"},
            "sync_address",
            ["sync.address = '0.0.0.0' differs from run.bind_address = '127.0.0.1'"],
        ),
        ({"run.ray_auth": "yes"}, "config_types", ["'run.ray_auth'", "expected bool"]),
        ({"task.num_bands": 0}, "task_config", ["num_bands"]),
        ({"training.world": 6}, "world_layout", ["training.world = 6"]),
    ],
)
def test_bad_values_are_refused_by_rule(overrides, rule, needles):
    with pytest.raises(ContractError) as e:
        load_e2e_config(TINY, overrides)
    assert e.value.rule == rule, str(e.value)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in {str(e.value)!r}"


def test_cli_refuses_with_exit_2(tmp_path, capsys):
    assert main(["--config", str(TINY), "--set", "grpo.steps=0"]) == 2
    assert "[grpo_config] grpo.steps = 0" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text() + "\n[grpo]\nsteps = 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert tomllib.loads(TINY.read_text())["grpo"]["steps"] == 2


# --- the metrics of one step --------------------------------------------------------------------
def _sample(prompt: list[int], lps: list[float]) -> dict:
    return {"prompt": prompt, "output_ids": list(range(len(lps))), "logprobs": lps}


def _trainer(prompt: list[int], lps: list[float]) -> torch.Tensor:
    """The trainer's values for tokens 1..n-1: prompt positions first, then the response's."""
    return torch.tensor([-9.0] * (len(prompt) - 1) + lps, dtype=torch.float32)


def _next_float(x: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def test_equal_log_probs_give_exact_zeros():
    lps = [float(torch.tensor(v, dtype=torch.float32)) for v in (-0.5, -2.25, -7.1)]
    m = logprob_metrics([_sample([1, 2, 3], lps)], [_trainer([1, 2, 3], lps)])
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0
    assert m["train/train_rollout_kl"] == 0.0
    assert m["train/logprob_equal_frac"] == 1.0 and m["train/tokens_compared"] == 3


def test_one_ulp_is_seen_by_every_metric():
    """The control: one log-prob one float32 ulp off (the smallest possible difference)."""
    lps = [float(torch.tensor(v, dtype=torch.float32)) for v in (-0.5, -2.25, -7.1)]
    off = [lps[0], _next_float(lps[1]), lps[2]]
    m = logprob_metrics([_sample([1, 2], lps)], [_trainer([1, 2], off)])
    assert m["train/train_rollout_logprob_abs_diff"] > 0.0
    assert m["train/train_rollout_kl"] > 0.0
    assert m["train/logprob_equal_frac"] == 2 / 3
    assert m["train/logprob_max_abs_diff"] == abs(off[1] - lps[1])


def test_final_table_has_a_row_per_step():
    rows = [{"step": 1, "train/train_rollout_logprob_abs_diff": 0.0,
             "train/train_rollout_kl": 0.0, "grad_norm": 0.0377, "weight_version": 1},
            {"step": 2, "train/train_rollout_logprob_abs_diff": 1e-9}]  # fmt: skip
    lines = format_table(rows).splitlines()
    assert len(lines) == 3 and lines[0].split()[:3] == ["step", "abs_diff", "kl"]
    assert lines[1].split()[:3] == ["1", "0.0", "0.0"] and "0.0377" in lines[1]
    assert lines[2].split()[:3] == ["2", "1e-09", "-"]


def _numeric_keys(e) -> list[tuple[str, str, object]]:
    tables = {"grpo": e.grpo, "loss": e.loss, "optimizer": e.optimizer, "sync": e.sync,
              "run": e.run, "data": e.data, "reward": e.reward, "eval": e.eval,
              "task": e.task}  # fmt: skip
    return [(t, f.name, getattr(obj, f.name)) for t, obj in tables.items() if obj is not None
            for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), int | float)
            and not isinstance(getattr(obj, f.name), bool)]  # fmt: skip


def test_every_numeric_key_of_every_table_has_a_range_rule():
    """Found by walking the tables, not listed: a negative count, and a NaN or infinite float,
    is refused by a rule naming the key, before anything starts. (Only a reward threshold may
    be negative: custom rewards may be.)"""
    from onpolicy.grpo.config import load_e2e_config

    negative_ok = {"eval.pass_threshold"}
    seen = 0
    for config in (TINY, MATH):
        for table, key, value in _numeric_keys(load_e2e_config(config)):
            name = f"{table}.{key}"
            bads = [float("nan"), float("inf"), -float("inf")] if isinstance(value, float) else []
            bads += [] if name in negative_ok else [-1]
            for bad in bads:
                with pytest.raises((ContractError, ValueError)) as err:
                    load_e2e_config(config, {name: bad})
                assert key in str(err.value), (name, bad, str(err.value))
                seen += 1
    assert seen >= 60, seen
