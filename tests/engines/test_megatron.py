"""The patched megatron-core on CPU/gloo: every layout builds, matches HF, and trains.

Each case is its own torchrun launch (a fresh process group) of workers/megatron_step.py,
which loads the tiny HF checkpoint into its shard, writes the gathered logits of a
forward-only pass, then takes two DDP + Adam steps through Megatron's schedules.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "megatron_step.py"
# Different kernels and reduction orders than HF; fp32 keeps them within this bound.
LOGIT_ATOL = 1e-4

LAYOUTS = {
    "world1": (1, []),
    "tp2-sp": (2, ["--tp", "2", "--sp"]),
    "pp2": (2, ["--pp", "2"]),
    "ep2": (2, ["--ep", "2"]),
    "tp2-pp2-ep2-sp-distopt": (8, ["--tp", "2", "--pp", "2", "--ep", "2", "--sp", "--distopt"]),
}


def run_layout(torchrun, ckpt: Path, out: Path, name: str) -> tuple[dict, dict]:
    nproc, args = LAYOUTS[name]
    out.mkdir(parents=True, exist_ok=True)
    torchrun(WORKER, nproc, "--ckpt", str(ckpt), "--out", str(out), *args)
    return torch.load(out / "logits.pt"), torch.load(out / "train.pt")


@pytest.fixture(scope="module")
def world1(torchrun, tiny_checkpoint, tmp_path_factory):
    return run_layout(torchrun, tiny_checkpoint, tmp_path_factory.mktemp("w1"), "world1")


def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([hf_model(mb[:, :-1]).logits for mb in tokens])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_hf_and_trains(name, torchrun, tiny_checkpoint, hf_model, world1, tmp_path):
    fwd, train = (
        world1 if name == "world1" else run_layout(torchrun, tiny_checkpoint, tmp_path, name)
    )
    ref = hf_logits(hf_model, fwd["tokens"])
    diff = (fwd["logits"] - ref).abs().max().item()
    assert diff < LOGIT_ATOL, f"{name}: max |logit - HF| = {diff:.3e}"
    assert torch.equal(fwd["logits"].argmax(-1), ref.argmax(-1))

    losses, norms = train["losses"], train["grad_norms"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses + norms), train
    assert losses[1] < losses[0], f"{name}: the optimizer step did not lower the loss: {losses}"
    # Before any update the loss and grad norm depend only on the weights, not the layout.
    w1_losses, w1_norms = world1[1]["losses"], world1[1]["grad_norms"]
    assert losses[0] == pytest.approx(w1_losses[0], rel=1e-5), (losses, w1_losses)
    assert norms[0] == pytest.approx(w1_norms[0], rel=1e-4), (norms, w1_norms)
