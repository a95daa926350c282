"""The same patched megatron-core on CUDA + NCCL: the CPU series must leave it working there.

One GPU, world 1: build, load the tiny HF checkpoint, match HF logits, take DDP + Adam steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from test_megatron import WORKER, hf_logits  # noqa: E402

pytestmark = pytest.mark.gpu
# cuBLAS may use TF32 and other reduction orders than the CPU; still far below a wrong weight.
LOGIT_ATOL = 2e-3


def test_world1_on_cuda_matches_hf_and_trains(torchrun, tiny_checkpoint, hf_model, tmp_path):
    torchrun(WORKER, 1, "--ckpt", str(tiny_checkpoint), "--out", str(tmp_path), "--device", "cuda")
    fwd, train = torch.load(tmp_path / "logits.pt"), torch.load(tmp_path / "train.pt")
    diff = (fwd["logits"] - hf_logits(hf_model, fwd["tokens"])).abs().max().item()
    assert diff < LOGIT_ATOL, f"max |logit - HF| on CUDA = {diff:.3e}"
    losses = train["losses"]
    assert len(losses) == 2 and losses[1] < losses[0], train
