"""The exact Megatron spec on one H200 (world 1, NCCL) at Qwen3-30B-A3B's layer dims: hidden
2048, 32 query / 4 KV heads of 128, 128 experts top-8 of width 768, vocab 151936, 4 layers, bf16.

One packed batch of mixed lengths (1 to 2049 tokens, one THD micro-batch): every log-prob of
`train.logprobs` equals the Triton reference model's `score` on the same checkpoint, bit for
bit. The negative control is megatron-core's stock local spec on the same weights and
sequences: its log-probs must differ. Then one PPO step through Megatron DDP and the
distributed optimizer: at the weights the log-probs came from every ratio is exactly 1 (nothing
clipped), the gradient is finite and non-zero, and the step moves the log-probs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from onpolicy.bits import n_differ
from onpolicy.models import write_tiny_checkpoint
from onpolicy.models.tiny import tiny

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).parent / "workers" / "megatron_exact_cuda.py"
DIMS = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "vocab_size": 151936, "num_hidden_layers": 4,
        "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "norm_topk_prob": True}  # fmt: skip
LENGTHS = [1, 2049, 300, 17, 1024, 5]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def run(torchrun, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron-exact-cuda")
    ckpt = write_tiny_checkpoint(tmp / "ckpt", tiny(**DIMS), seed=0)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, DIMS["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]
    (tmp / "seqs.json").write_text(json.dumps(seqs))
    torchrun(WORKER, 1, "--ckpt", str(ckpt), "--sequences", str(tmp / "seqs.json"),
             "--out", str(tmp), "--temperature", str(TEMPERATURE), timeout=1500)  # fmt: skip
    return ckpt, seqs, torch.load(tmp / "result.pt")


def test_exact_spec_equals_the_reference_and_the_stock_spec_does_not(run):
    from onpolicy.models.reference import Qwen3MoeReference

    ckpt, seqs, res = run
    ref = Qwen3MoeReference.from_pretrained(ckpt, torch.bfloat16).to("cuda")
    want = [x.cpu() for x in ref.score(seqs, TEMPERATURE)]
    del ref
    got = res["exact"]
    assert [len(x) for x in got] == [n - 1 for n in LENGTHS]
    bad = sum(n_differ(a, b) for a, b in zip(got, want, strict=True))
    total = sum(len(x) for x in want)
    print(f"exact Megatron (world 1, CUDA) vs reference score: {bad} of {total} differ; "
          f"peak memory {res['max_memory_gib']:.1f} GiB")  # fmt: skip
    assert bad == 0 and total == sum(LENGTHS) - len(LENGTHS)
    long_want = [w for w, n in zip(want, LENGTHS, strict=True) if n > 1]
    stock_bad = sum(n_differ(a, b) for a, b in zip(res["stock"], long_want, strict=True))
    print(f"stock local spec vs reference score: {stock_bad} of {total} differ")
    assert stock_bad > 0


def test_one_ppo_step_on_cuda(run):
    _, _, res = run
    step = res["step"]
    print(f"PPO step: {step}")
    assert step["num_tokens"] == sum(LENGTHS) - len(LENGTHS)
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
    assert step["grad_norm"] > 0
    assert step["metrics"]["ratio"] == 1.0 and step["metrics"]["clip_frac"] == 0.0, step
    moved = sum(n_differ(a, b) for a, b in zip(res["after"], res["exact"], strict=True))
    assert moved > 0
