"""The seeded tiny Qwen3-MoE writer: byte-identical per seed, every size settable, loadable."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from onpolicy.models import tiny, write_tiny_checkpoint
from onpolicy.models.tiny import DONE


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=5)
    b = write_tiny_checkpoint(tmp_path / "b", seed=5)
    c = write_tiny_checkpoint(tmp_path / "c", seed=6)
    assert digests(a) == digests(b)
    assert digests(a)["model.safetensors"] != digests(c)["model.safetensors"]
    assert (a / DONE).is_file()


def test_sizes_are_settable_and_transformers_loads_it(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=3,
               moe_intermediate_size=16, torch_dtype="float32")  # fmt: skip
    path = write_tiny_checkpoint(tmp_path / "m", cfg, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 3
    assert model.model.layers[1].self_attn.q_proj.weight.shape == (64, 32)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 512 and tok.eos_token_id == 511
    ids = tok("kalo rite mon. any text at all!").input_ids
    assert max(ids) < 512 and tok.decode(ids) == "kalo rite mon. any text at all!"


def test_rewrite_replaces_the_folder_and_leaves_no_temporaries(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", seed=0)
    (path / "stale.bin").write_text("x")
    write_tiny_checkpoint(tmp_path / "m", seed=0)
    assert not (path / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"torch_dtype": "float16"}, "torch_dtype must be bfloat16 or float32"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads = 3"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 exceeds num_experts = 8"),
        ({"vocab_size": 100}, "vocab_size (100) must be at least 259"),
        ({"hidden_size": 0}, "hidden_size = 0 must be a positive integer"),
        ({"hidden": 64}, "unknown dims ['hidden']"),
    ],
)
def test_bad_sizes_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(ValueError) as e:
        write_tiny_checkpoint(tmp_path / "m", tiny(**change))
    assert message in str(e.value)
    assert not (tmp_path / "m").exists()


def test_config_json_round_trips_to_the_shape(tmp_path):
    from onpolicy.models import TINY, Qwen3MoeConfig

    path = write_tiny_checkpoint(tmp_path / "m", seed=0)
    assert Qwen3MoeConfig.from_hf(path) == TINY
    assert Qwen3MoeConfig.from_hf(TINY.to_hf()) == TINY
