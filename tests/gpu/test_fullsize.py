"""Prefill == decode at Qwen3-30B-A3B's full shape on one GPU (random weights, ~61 GB)."""

import pytest
import torch
from onpolicy.bench import fullsize
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    from onpolicy.models.reference import Qwen3MoeReference

    free, _ = torch.cuda.mem_get_info()
    if free < 70 * 2**30:
        pytest.skip(f"needs ~70 GiB of free GPU memory, this device has {free / 2**30:.0f} GiB")
    return Qwen3MoeReference.random(QWEN3_30B_A3B, dtype=torch.bfloat16, device="cuda", seed=0)


def test_every_generated_token_matches_its_score_bitwise(model):
    res = fullsize.run(QWEN3_30B_A3B, requests=8, new_tokens=16, model=model)
    print(res.line())
    assert res.tokens == 8 * 16
    assert res.equal == res.tokens, res.line()


def test_negative_control_native_ops_break_prefill_equals_decode(model):
    res = fullsize.run(QWEN3_30B_A3B, requests=8, new_tokens=16, model=model, native=True)
    print(res.line())
    assert res.equal < res.tokens, res.line()
