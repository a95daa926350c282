"""SGLang's stock CUDA path with its fused ops forced to torch (`SGLANG_FORCE_FUSED_OP_BACKEND`),
as the CUDA stock control runs where sgl-kernel is absent: Qwen3-MoE must not hand RoPE a fused
KV-cache write, which RoPE's forward_native refuses (an AssertionError at the first forward on
an H100). The patched `enable_fused_set_kv_buffer` says no fused write under forced torch ops
and keeps upstream's answer otherwise; the control is the same CUDA bf16 pool with no forced
backend, where it says yes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.kernels import fused_op
from sglang.kernels.spec import KernelBackend
from sglang.srt.models import utils


@pytest.fixture
def cuda_bf16_pool(monkeypatch):
    """The function's CUDA bf16 branch on this CPU machine: a bf16 KV pool, no context
    parallelism; the process-wide forced backend restored after."""
    monkeypatch.setattr(utils, "_is_cuda", True)
    monkeypatch.setattr(utils, "get_token_to_kv_pool", lambda: SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(utils, "is_cp_active", lambda batch: False)
    before = fused_op.get_fused_op_backend()
    yield SimpleNamespace(dcp_kv_mask=None)
    fused_op.set_fused_op_backend(before)


@pytest.mark.parametrize("forced", [KernelBackend.TORCH, KernelBackend.TORCH_COMPILE])
def test_forced_torch_ops_write_the_kv_cache_in_the_attention(cuda_bf16_pool, forced):
    fused_op.set_fused_op_backend(forced)
    assert utils.enable_fused_set_kv_buffer(cuda_bf16_pool) is False


def test_without_a_forced_backend_cuda_bf16_keeps_the_fused_write(cuda_bf16_pool):
    fused_op.set_fused_op_backend(None)
    assert utils.enable_fused_set_kv_buffer(cuda_bf16_pool) is True
