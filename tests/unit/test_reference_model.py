"""The reference Qwen3-MoE: loads the tiny HF checkpoint and real configs, agrees with HF
transformers within a tolerance, and gives bit-identical log-probs for a token whether it was
scored by packed prefill or produced by paged decode, alone or in a batch, in any chunking.
"""

from __future__ import annotations

import pytest
import torch
from adversarial import DEVICES, assert_bitwise, bitwise_equal, mismatch_report
from onpolicy import kernels as K
from onpolicy.models import tiny, write_tiny_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.models.reference import PagedKVCache, Qwen3MoeReference, Request

DTYPES = ["bfloat16", "float32"]

# Published config.json values of Qwen3-30B-A3B and Qwen3-235B-A22B (the fields that matter).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "intermediate_size": 12288,
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("tiny")
    return {dt: write_tiny_checkpoint(root / dt, tiny(torch_dtype=dt), seed=0) for dt in DTYPES}


@pytest.fixture(scope="module", params=DEVICES)
def models(checkpoints, request) -> dict[str, Qwen3MoeReference]:
    """The tiny model per dtype, on each device (the cuda case runs the Triton backend)."""
    return {dt: Qwen3MoeReference.from_pretrained(p).to(request.param)
            for dt, p in checkpoints.items()}  # fmt: skip


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 990, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g)
            .tolist() for _ in range(n)]  # fmt: skip


# --- configs and loading ----------------------------------------------------------------------
def test_reads_tiny_and_published_configs(checkpoints):
    tiny = Qwen3MoeConfig.from_hf(checkpoints["bfloat16"])
    assert (tiny.hidden_size, tiny.num_experts, tiny.num_experts_per_tok) == (64, 8, 2)
    assert tiny.dtype == torch.bfloat16 and tiny.rope_theta == 1e6
    cfg = Qwen3MoeConfig.from_hf(QWEN3_30B_A3B)
    assert (cfg.head_dim, cfg.moe_intermediate_size, cfg.eos_token_id) == (128, 768, 151645)
    # transformers 5 writes the RoPE base under rope_parameters.
    v5 = {**QWEN3_30B_A3B, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert Qwen3MoeConfig.from_hf(v5).rope_theta == 5e5


@pytest.mark.parametrize(("config", "params"), [(QWEN3_30B_A3B, 30.5e9), (QWEN3_235B_A22B, 235e9)])
def test_builds_published_shapes(config, params):
    """The real architectures instantiate (on the meta device) with the published sizes."""
    with torch.device("meta"):
        model = Qwen3MoeReference(Qwen3MoeConfig.from_hf(config))
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - params) / params < 0.01


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "qwen3"}, "model_type"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_refuses_what_the_kernels_do_not_cover(change, field):
    with pytest.raises(ValueError, match=field):
        Qwen3MoeConfig.from_hf({**QWEN3_30B_A3B, **change})


# --- against HF transformers ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_matches_hf_transformers(checkpoints, models, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints[dtype], dtype=getattr(torch, dtype))
    seqs = [torch.tensor(p) for p in prompts(3, seed=1)] + [torch.arange(100, 200)]
    ours = models[dtype].score(seqs)
    diffs = []
    for s, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = hf(s[None]).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
        diffs.append((lp.cpu() - ref).abs())
    d = torch.cat(diffs)
    if dtype == "float32":
        assert d.max() < 1e-4, f"max |ours - hf| = {d.max():.2e}"
    else:
        # bf16 rounds at different points (RoPE, SiLU, routing weights, fp32 combine), and a
        # near-tie can route a token to another expert; most tokens stay within bf16 precision.
        assert d.median() < 2e-2 and (d < 0.1).float().mean() > 0.9, f"median {d.median():.2e}"


# --- decode equals score ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_logprobs_equal_score_logprobs_over_100_tokens(models, dtype):
    model = models[dtype]
    reqs = model.generate(prompts(3, seed=2), max_new_tokens=110, temperature=1.0, seed=7,
                          chunk_size=16)  # fmt: skip
    assert all(len(r.output) == 110 for r in reqs)
    assert decode_equals_score(model, reqs, temperature=1.0) == []


def as_tensor(logprobs: list[float]) -> torch.Tensor:
    """A request's log-probs back as the fp32 tensor they came from (float64 holds fp32 exactly,
    the sign of zero included)."""
    return torch.tensor(logprobs, dtype=torch.float32)


def decode_equals_score(model, reqs, temperature: float) -> list[str]:
    """Each request's sampled log-probs against `score` of its whole sequence; the mismatches."""
    scored = model.score([r.tokens for r in reqs], temperature=temperature)
    bad = []
    for r, lp in zip(reqs, scored, strict=True):
        decoded, from_score = as_tensor(r.logprobs), lp[len(r.prompt) - 1 :].cpu()
        if not bitwise_equal(decoded, from_score):
            bad.append(f"request {r.rid}: " + mismatch_report(decoded, from_score))
    return bad


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_greedy_and_tempered_decode_equal_score(models, temperature):
    model = models["bfloat16"]
    reqs = model.generate(prompts(2, seed=3), max_new_tokens=40, temperature=temperature, seed=2)
    assert decode_equals_score(model, reqs, temperature or 1.0) == []


def test_negative_control_plain_ops_break_decode_equals_score(models):
    """The same harness on the plain torch ops (MKL linear, SDPA, torch reductions): a decoded
    token's log-prob is no longer its prefill log-prob."""
    model = models["float32"]
    ps = prompts(3, seed=2)
    with K.native_ops():
        reqs = model.generate(ps, max_new_tokens=110, temperature=1.0, seed=7, chunk_size=16)
        bad = decode_equals_score(model, reqs, temperature=1.0)
    assert bad, "plain ops gave decode == score on every request"


# --- batch, chunk and page layout independence -------------------------------------------------
def run_alone(model, prompt, rid, chunk, new_tokens, page_size=16):
    return model.generate([prompt], max_new_tokens=new_tokens, temperature=0.9, seed=5,
                          chunk_size=chunk, page_size=page_size, rids=[rid])[0]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_generation_is_independent_of_batch_and_chunking(models, dtype):
    model = models[dtype]
    ps = prompts(4, seed=4)
    batch = model.generate(ps, max_new_tokens=24, temperature=0.9, seed=5, chunk_size=7,
                           rids=[10, 11, 12, 13])  # fmt: skip
    target = batch[2]
    for chunk, page in ((None, 16), (1, 8), (5, 4)):
        alone = run_alone(model, ps[2], 12, chunk, 24, page)
        assert alone.output == target.output, (chunk, page)
        assert_bitwise(as_tensor(alone.logprobs), as_tensor(target.logprobs), f"{chunk}, {page}")


def test_requests_can_join_a_running_batch(models):
    """A request prefilled while another is mid-decode gets the bits it gets alone."""
    model = models["bfloat16"]
    ps = prompts(2, seed=6)
    cache = PagedKVCache(model.cfg, model.dtype, page_size=16, num_pages=16, device=model.device)
    a = Request(rid=1, prompt=ps[0], temperature=1.0, seed=3)
    b = Request(rid=2, prompt=ps[1], temperature=1.0, seed=3)
    model.prefill([a], cache)
    for _ in range(5):
        model.decode([a], cache)
    model.prefill([b], cache, chunk_size=8)
    for _ in range(10):
        model.decode([a, b], cache)
    ref_a = model.generate([ps[0]], max_new_tokens=16, temperature=1.0, seed=3, rids=[1])[0]
    ref_b = model.generate([ps[1]], max_new_tokens=11, temperature=1.0, seed=3, rids=[2])[0]
    assert (a.output, b.output) == (ref_a.output, ref_b.output)
    assert_bitwise(as_tensor(a.logprobs), as_tensor(ref_a.logprobs), "request a")
    assert_bitwise(as_tensor(b.logprobs), as_tensor(ref_b.logprobs), "request b")


def test_sampling_is_seeded_per_request(models):
    model = models["bfloat16"]
    p = prompts(1, seed=8)
    one = model.generate(p * 2, max_new_tokens=20, temperature=1.0, seed=1)
    assert one[0].output != one[1].output  # same prompt, different request ids
    again = model.generate(p, max_new_tokens=20, temperature=1.0, seed=1)
    other = model.generate(p, max_new_tokens=20, temperature=1.0, seed=2)
    assert again[0].output == one[0].output
    assert other[0].output != one[0].output


# --- negative control -------------------------------------------------------------------------
def test_negative_control_hf_decode_differs_from_its_prefill(checkpoints):
    """HF transformers (SDPA, MKL matmuls) decoding with its KV cache gives log-probs that are
    not bit-equal to scoring the same tokens in one prefill."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["float32"], dtype=torch.float32)
    seq = torch.tensor(prompts(1, seed=9)[0] + list(range(300, 420)))[None]
    with torch.no_grad():
        full = torch.log_softmax(hf(seq).logits[0].float(), -1)
        out = hf(seq[:, :5], use_cache=True)
        steps = [torch.log_softmax(out.logits[0].float(), -1)]
        cache = out.past_key_values
        for i in range(5, seq.shape[1]):
            out = hf(seq[:, i : i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(torch.log_softmax(out.logits[0].float(), -1))
    decoded = torch.cat(steps)
    assert decoded.shape == full.shape
    assert not bitwise_equal(decoded, full)
