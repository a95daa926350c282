"""The patched SGLang Engine on CPU (no sgl-kernel, no torchvision) against HF transformers.

Each layout starts a real `sglang.Engine(device="cpu")` in a subprocess (workers/
sglang_generate.py) on the tiny checkpoint, including its tokenizer. Greedy tokens must equal
HF `generate`; sampled tokens come with per-token log-probs that must be log_softmax of the
HF logits at the sampled token (temperature 1), within a kernel-difference tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "sglang_generate.py"
PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [500, 600, 700, 800, 900]]
NEW_TOKENS = 16
LOGPROB_ATOL = 1e-4
LAYOUTS = {"tp1": (1, 1), "tp2-ep2": (2, 2)}


def run_engine(ckpt: Path, tmp: Path, tp: int, ep: int, cache: Path) -> dict:
    from onpolicy.rollout import engine_env

    out = tmp / "result.json"
    env = engine_env(tp, cache, base=os.environ)
    cmd = [sys.executable, str(WORKER), "--ckpt", str(ckpt), "--out", str(out),
           "--tp", str(tp), "--ep", str(ep), "--new-tokens", str(NEW_TOKENS),
           "--prompts", json.dumps(PROMPTS)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        pytest.fail(f"SGLang engine tp={tp} ep={ep} exited {p.returncode}\n{p.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engine_result(request, tiny_checkpoint, tmp_path_factory, compile_cache):
    tp, ep = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp("sgl")
    return request.param, run_engine(tiny_checkpoint, tmp, tp, ep, compile_cache)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with full forwards: no cache, no stop token (the engine ignores EOS)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.slow
def test_greedy_matches_hf(engine_result, hf_model):
    name, res = engine_result
    for prompt, got in zip(PROMPTS, res["greedy"], strict=True):
        want = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert got == want, f"{name}: prompt {prompt}: sglang {got} != HF {want}"


@pytest.mark.slow
def test_sampled_logprobs_are_the_models(engine_result, hf_model):
    name, res = engine_result
    for prompt, s in zip(PROMPTS, res["sampled"], strict=True):
        assert len(s["output_ids"]) == NEW_TOKENS and s["logprob_tokens"] == s["output_ids"]
        seq = torch.tensor([prompt + s["output_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(seq).logits[0].float(), dim=-1)
        pos = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        want = logp[pos, seq[0, pos + 1]]
        got = torch.tensor(s["logprobs"])
        diff = (got - want).abs().max().item()
        assert diff < LOGPROB_ATOL, f"{name}: max |logprob - HF| = {diff:.3e}"
    # The offline tokenizer is loaded by the engine: a text prompt decodes back to text.
    assert isinstance(res["text"], str) and res["text"]
