"""The HF -> Megatron shard mapping: refusals of bad checkpoints and layouts, and coverage.

The numerical check of the mapping is tests/engines/test_megatron.py (logits == HF at every
layout); these are the cheap, single-process properties.
"""

from __future__ import annotations

import pytest
import torch
from onpolicy.layout import ParallelLayout
from onpolicy.models import tiny as tiny_shape
from onpolicy.models import write_tiny_checkpoint
from onpolicy.models.hf_layout import hf_tensor_shapes, read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.hf_megatron import (
    hf_tensors_of,
    hf_to_megatron,
    megatron_to_hf,
    parse_megatron_name,
    split_qkv,
)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    hf = read_hf_checkpoint(tiny_checkpoint, strict=False).tensors
    return Qwen3MoeConfig.from_hf(tiny_checkpoint), hf


def test_missing_and_misshaped_tensors_are_named(tiny):
    cfg, sd = tiny
    bad = dict(sd)
    del bad["model.layers.2.mlp.experts.5.up_proj.weight"]
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(ValueError) as e:
        hf_to_megatron(cfg, bad, ParallelLayout(world=1), 0, torch.float32)
    msg = str(e.value)
    assert "1 missing, e.g. model.layers.2.mlp.experts.5.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight (3, 64) (config wants (32, 64))" in msg


def test_layout_that_does_not_divide_the_model_is_refused(tiny):
    cfg, sd = tiny
    with pytest.raises(ValueError, match="4 layers over PP=3"):
        hf_to_megatron(cfg, sd, ParallelLayout(world=3, pp=3), 0, torch.float32)


def test_shards_tile_the_global_tensors(tiny):
    """Over all ranks of TP2 PP2 EP2, every HF element lands in exactly one place per role."""
    cfg, sd = tiny
    layout = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
    total = 0
    for rank in range(8):
        shard = hf_to_megatron(cfg, sd, layout, rank, torch.float32)
        # Expert weights are split over EP (ETP 1), the rest over TP or replicated.
        total += sum(v.numel() for k, v in shard.items() if "experts" in k)
    experts = sum(v.numel() for k, v in sd.items() if ".mlp.experts." in k)
    assert total == 2 * experts  # each EP shard appears on both DP ranks of its stage


def test_a_wider_checkpoint_is_read_as_configured(tmp_path):
    cfg = tiny_shape(num_experts=4, num_experts_per_tok=1, num_hidden_layers=2, vocab_size=300)
    path = write_tiny_checkpoint(tmp_path / "small", cfg, seed=1)
    assert Qwen3MoeConfig.from_hf(path) == cfg
    sd = read_hf_checkpoint(path, strict=False).tensors
    shard = hf_to_megatron(cfg, sd, ParallelLayout(world=1), 0, torch.float32)
    assert shard["output_layer.weight"].shape == (300, 64)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in shard


def test_world1_round_trip_is_bit_identical(tiny):
    """HF -> world-1 Megatron -> HF returns every tensor with the same bits and order."""
    cfg, sd = tiny
    back = megatron_to_hf(cfg, hf_to_megatron(cfg, sd, ParallelLayout(world=1), 0, sd[
        "lm_head.weight"].dtype))  # fmt: skip
    assert list(back) == list(hf_tensor_shapes(cfg)) and set(back) == set(sd)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.int16),
                                                           t.view(torch.int16)), name  # fmt: skip


def test_a_swapped_qkv_split_is_caught(tiny):
    """Negative control: the round trip sees a k/v mix-up (the check can fail)."""
    cfg, sd = tiny
    mg = hf_to_megatron(cfg, sd, ParallelLayout(world=1), 0, torch.float32)
    q, k, v = split_qkv(cfg, mg["decoder.layers.0.self_attention.linear_qkv.weight"])
    assert torch.equal(k, sd["model.layers.0.self_attn.k_proj.weight"].float())
    assert not torch.equal(k, sd["model.layers.0.self_attn.v_proj.weight"].float())


def test_expert_and_layer_ids_are_applied_as_given(tiny):
    cfg, _ = tiny
    base, layer, expert = parse_megatron_name(
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert (base, layer, expert) == ("mlp.experts.linear_fc2.weight", 1, 3)
    names = [n for n, _ in hf_tensors_of(cfg, base, torch.zeros(64, 32), layer=3, expert=7)]
    assert names == ["model.layers.3.mlp.experts.7.down_proj.weight"]
    with pytest.raises(ValueError, match="no HF counterpart"):
        hf_tensors_of(cfg, "mlp.router.expert_bias", torch.zeros(8), layer=0)
