"""The trainer's backward repeats bit for bit on CUDA (`train.builder.deterministic_cuda`, which
`init_parallel` applies on CUDA), so a resumed run can continue the uninterrupted one.

The case is the accumulation of many rows into few (an fp32 `index_add_`, as the native MoE
adds expert outputs into each token's row). Run again and again, it must give one set of bits
with the deterministic setting; the negative control, the same loop without it, gives more than
one (CUDA's atomic adds land in varying order). Bits compare as integer views.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
REPEATS = 20


@pytest.fixture
def restore():
    """torch's global determinism settings and the cuBLAS variable, put back after the test."""
    from torch.utils import deterministic

    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             deterministic.fill_uninitialized_memory,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))  # fmt: skip
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    deterministic.fill_uninitialized_memory = saved[2]
    if saved[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[3]


def index_add_digests() -> set[str]:
    """SHA-256 of the bits of an fp32 `index_add_` of 65536 rows into 64, once per repeat (same
    inputs): the accumulation the native MoE does (`kernels.native`), and the one that varies
    on CUDA without the setting (the backward of a gather, `x[tok]`, already sorts)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tok = torch.randint(0, 64, (65536,), device="cuda", generator=g)
    src = torch.randn(65536, 2048, device="cuda", generator=g)
    out = set()
    for _ in range(REPEATS):
        acc = torch.zeros(64, 2048, device="cuda").index_add_(0, tok, src)
        torch.cuda.synchronize()
        out.add(hashlib.sha256(acc.view(torch.int32).cpu().numpy().tobytes()).hexdigest())
    return out


def test_negative_control_the_backward_varies_without_the_setting(restore):
    torch.use_deterministic_algorithms(False)
    assert len(index_add_digests()) > 1


def test_the_backward_repeats_bit_for_bit_with_the_setting(restore):
    from onpolicy.train.builder import deterministic_cuda

    deterministic_cuda()
    assert len(index_add_digests()) == 1
