"""Who writes the KV cache in SGLang's Qwen3-MoE attention on CUDA.

With a bf16 KV pool on CUDA, SGLang hands RoPE a fused KV-cache write
(`enable_fused_set_kv_buffer`) and tells the attention backend not to save K and V. Two RoPEs
do no such write, so there the answer must be no and the attention saves them:
- the exact path (`rl_on_policy_target="onpolicy"`): onpolicy's QK-norm and RoPE. Without this
  the cache stayed unwritten on an H100 and the exact engine's log-probs were another model's
  (0 of 512 equal to Megatron's, which equal the reference model's);
- SGLang's own ops forced to torch (`SGLANG_FORCE_FUSED_OP_BACKEND`), as the CUDA stock control
  runs where sgl-kernel is absent: RoPE's forward_native refuses the argument.

The function's CUDA branch runs on this CPU machine with a bf16 pool; the control is the same
pool with neither, where upstream's answer (yes) stands. tests/engines/test_sglang_exact.py runs
its TP2 engines in that branch end to end.
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
    """A bf16 pool on "CUDA", no context parallelism, no on-policy target; the process-wide
    forced backend restored after. Yields a function that sets the target."""
    monkeypatch.setattr(utils, "_is_cuda", True)
    monkeypatch.setattr(
        utils, "get_token_to_kv_pool", lambda: SimpleNamespace(dtype=torch.bfloat16)
    )
    monkeypatch.setattr(utils, "is_cp_active", lambda batch: False)

    def target(name):
        exec_ = SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=name))
        monkeypatch.setattr(utils, "get_exec", lambda: exec_)

    target(None)
    before = fused_op.get_fused_op_backend()
    fused_op.set_fused_op_backend(None)
    yield target
    fused_op.set_fused_op_backend(before)


BATCH = SimpleNamespace(dcp_kv_mask=None)


def test_the_exact_path_saves_the_kv_cache_in_the_attention(cuda_bf16_pool):
    cuda_bf16_pool("onpolicy")
    assert utils.enable_fused_set_kv_buffer(BATCH) is False


@pytest.mark.parametrize("forced", [KernelBackend.TORCH, KernelBackend.TORCH_COMPILE])
def test_forced_torch_ops_save_the_kv_cache_in_the_attention(cuda_bf16_pool, forced):
    fused_op.set_fused_op_backend(forced)
    assert utils.enable_fused_set_kv_buffer(BATCH) is False


def test_otherwise_cuda_bf16_keeps_the_fused_write(cuda_bf16_pool):
    assert utils.enable_fused_set_kv_buffer(BATCH) is True
