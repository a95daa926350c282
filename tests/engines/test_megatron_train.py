"""PPO-clip training on the patched megatron-core (onpolicy.train.step), on CPU/gloo.

- Gradient: the finalized gradient of the PPO loss through Megatron (DDP buffers, after the
  DP/SP reductions and the global token-mean division) equals HF transformers' autograd
  gradient of the same loss (PPO-clip plus a k3 KL term) on the same checkpoint and batch, in
  fp32, within GRAD_RTOL of each tensor's largest entry, at world 1, TP2+SP, PP2 and EP2. The
  same comparison must fail for a wrong gradient: advantages negated, or one HF weight
  perturbed.
- Step: DDP + the distributed optimizer at TP2+SP x DP2 take two steps; the weights move from
  the checkpoint, the loss falls, and the DP replicas hold the same bits.
- Determinism: the same seeded two-step training in two separate torchrun launches gives
  bit-identical parameters on every rank, in fp32 and bf16; another seed's batch (the control)
  gives different bits.

Each layout is one torchrun launch of workers/megatron_train.py; a launch does several runs.
"""

from __future__ import annotations

from math import inf
from pathlib import Path

import pytest
import torch
from onpolicy.bits import bitwise_equal, mismatch_report, n_differ
from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.train.hf_megatron import hf_to_megatron
from onpolicy.train.loss import PPOClipConfig, ppo_clip_loss

WORKER = Path(__file__).parent / "workers" / "megatron_train.py"
GRAD_RTOL = 1e-4
"""Per tensor: max |grad - HF grad| <= GRAD_RTOL * max |HF grad|. Measured in fp32 on the tiny
model: at most 2.7e-6 at each layout (different kernels and summation orders, same math); the
controls measure at least 1.2 on every tensor (advantages negated; the clipped tokens change
and the KL term does not flip, so not exactly 2) and 3e-3 at the worst tensor (one norm
weight x 1.001)."""

GRAD_LAYOUTS = {
    "world1": (1, {}, []),
    "tp2-sp": (2, {"tp": 2, "sp": True}, ["--tp", "2", "--sp"]),
    "pp2": (2, {"pp": 2}, ["--pp", "2"]),
    "ep2": (2, {"ep": 2}, ["--ep", "2"]),
}


def load_records(out: Path) -> list[dict]:
    return [torch.load(f) for f in sorted(out.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))]


def hf_checkpoint_grads(model, cfg: Qwen3MoeConfig) -> dict[str, torch.Tensor]:
    """HF grads under the checkpoint's tensor names (transformers fuses each layer's experts
    into gate_up_proj [E, 2F, H] and down_proj [E, H, F]; the checkpoint has one per expert)."""
    f = cfg.moe_intermediate_size
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith("experts.gate_up_proj"):
            for e in range(g.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g[e, :f]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = g[e, f:]
        elif name.endswith("experts.down_proj"):
            for e in range(g.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = g[e]
        else:
            out[name] = g
    return out


_HF_CACHE: dict[tuple, tuple[float, dict[str, torch.Tensor]]] = {}
"""hf_grads of the checkpoint's weights by the bytes of its inputs: the layouts' batches are
the same bits (exact forward old log-probs), so one HF backward serves them all; a differing
batch is recomputed."""


def hf_grads(model, cfg: Qwen3MoeConfig, rec: dict, sign: float = 1.0):
    """The global batch's token-mean PPO loss through HF autograd; (loss, grads by HF name)."""
    inputs = ("sequences", "old_logprobs", "ref_logprobs", "advantages", "loss_masks")
    key = (sign, repr(rec["loss_config"]),
           *(t.numpy().tobytes() for k in inputs for t in rec[k]))  # fmt: skip
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_grads(model, cfg, rec, sign)
    return _HF_CACHE[key]


def _hf_grads(model, cfg: Qwen3MoeConfig, rec: dict, sign: float):
    loss_cfg = PPOClipConfig(**rec["loss_config"])
    model.zero_grad(set_to_none=True)
    total, n = 0.0, 0
    for seq, old, ref, adv, mask in zip(rec["sequences"], rec["old_logprobs"],
                                        rec["ref_logprobs"], rec["advantages"], rec["loss_masks"],
                                        strict=True):  # fmt: skip
        logits = model(seq[None]).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, seq[1:, None])[:, 0]
        out = ppo_clip_loss(lp, old, sign * adv, mask, loss_cfg, ref)
        total, n = total + out.loss_sum, n + int(out.num_tokens)
    loss = total / n
    loss.backward()
    return loss.item(), hf_checkpoint_grads(model, cfg)


def grad_errors(records: list[dict], layout: ParallelLayout, cfg, grads) -> dict[str, float]:
    """Per Megatron tensor and rank: max |grad - HF grad| / max |HF grad| (a tensor whose HF
    gradient is zero, an expert no token reached, must be exactly zero: 0 or inf)."""
    errs = {}
    for rank, rec in enumerate(records):
        expected = hf_to_megatron(cfg, grads, layout, rank, torch.float32)
        assert set(rec["grads"]) == set(expected), (rank, set(rec["grads"]) ^ set(expected))
        for name, g in rec["grads"].items():
            e = expected[name]
            scale = e.abs().max().item()
            err = (g - e).abs().max().item()
            errs[f"rank{rank}:{name}"] = err / scale if scale else (0.0 if err == 0 else inf)
    return errs


def grads_nonzero(records: list[dict], key: str) -> bool:
    rank, name = key.split(":", 1)
    return bool(records[int(rank[4:])]["grads"][name].abs().max() > 0)


@pytest.fixture(scope="module")
def hf_fp32(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRAD_LAYOUTS))
def test_ppo_gradient_matches_hf(name, torchrun, tiny_checkpoint, hf_fp32, tmp_path):
    nproc, degrees, args = GRAD_LAYOUTS[name]
    torchrun(WORKER, nproc, "--ckpt", str(tiny_checkpoint), "--out", str(tmp_path),
             "--mode", "grad", "--runs", "fp32:0", *args)  # fmt: skip
    records = load_records(tmp_path / "fp32-0")
    assert len(records) == nproc
    cfg = Qwen3MoeConfig.from_hf(tiny_checkpoint)
    layout = ParallelLayout(world=nproc, **degrees)
    rec = records[0]
    assert all(r["micro_batches"] == 2 // layout.dp for r in records), "two sequences a batch"

    loss, grads = hf_grads(hf_fp32, cfg, rec)
    sums = records[0]["sums"]
    assert sums["loss"] / sums["num_tokens"] == pytest.approx(loss, rel=1e-5), (sums, loss)
    assert 0 < sums["clip_frac_low"] and 0 < sums["clip_frac_high"], "both clip bounds active"
    assert rec["loss_config"]["kl_coef"] > 0 and sums["kl"] > 0, "the KL term is in the loss"
    errs = grad_errors(records, layout, cfg, grads)
    worst = max(errs, key=errs.get)
    print(f"{name}: {len(errs)} tensors, worst {worst} at {errs[worst]:.2e} (rtol {GRAD_RTOL})")
    assert errs[worst] <= GRAD_RTOL, f"{name}: {worst} relative error {errs[worst]:.3e}"

    # Negative controls: the same comparison against a wrong gradient must fail.
    _, negated = hf_grads(hf_fp32, cfg, rec, sign=-1.0)
    bad = grad_errors(records, layout, cfg, negated)
    live = [k for k in bad if grads_nonzero(records, k)]
    assert live and min(bad[k] for k in live) > GRAD_RTOL, "negated advantages must fail everywhere"
    weight = hf_fp32.get_parameter("model.layers.0.input_layernorm.weight")
    with torch.no_grad():
        weight.mul_(1 + 1e-3)
    try:
        _, perturbed = _hf_grads(hf_fp32, cfg, rec, 1.0)  # not cached: other weights
    finally:
        with torch.no_grad():
            weight.copy_(read_hf_checkpoint(tiny_checkpoint, strict=False).tensors[
                "model.layers.0.input_layernorm.weight"].float())  # fmt: skip
    worse = grad_errors(records, layout, cfg, perturbed)
    print(f"{name}: controls: negated min {min(bad[k] for k in live):.2e}, "
          f"perturbed max {max(worse.values()):.2e}")  # fmt: skip
    assert max(worse.values()) > GRAD_RTOL, "a perturbed weight must fail the comparison"


RUNS = ("fp32:0", "bf16:0", "fp32:1", "bf16:1")
"""Seed 1 is the control: another batch, so other bits."""
TRAIN_LAYOUT = ParallelLayout(world=4, tp=2, sp=True)
"""TP2 + SP x DP2: the DP reduce-scatter of the distributed optimizer and the SP reductions."""


@pytest.fixture(scope="module")
def train_launches(torchrun, tiny_checkpoint, tmp_path_factory) -> list[Path]:
    """Two separate launches of the same seeded two-step training at TRAIN_LAYOUT with the
    distributed optimizer; the second repeats the seed-0 runs only."""
    outs = []
    for i, runs in enumerate((RUNS, RUNS[:2])):
        out = tmp_path_factory.mktemp(f"train-{i}")
        torchrun(WORKER, TRAIN_LAYOUT.world, "--ckpt", str(tiny_checkpoint), "--out", str(out),
                 "--mode", "train", "--distopt", "--steps", "2", "--tp", str(TRAIN_LAYOUT.tp),
                 "--sp", "--runs", *runs)  # fmt: skip
        outs.append(out)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_distributed_optimizer_steps_at_tp2_dp2(dtype, train_launches, tiny_checkpoint):
    records = load_records(train_launches[0] / f"{dtype}-0")
    assert [(r["coords"]["tp"], r["coords"]["dp"]) for r in records] == [
        (0, 0), (1, 0), (0, 1), (1, 1)
    ]  # fmt: skip
    steps = records[0]["steps"]
    assert all(r["steps"] == steps for r in records), "every rank reports the same results"
    tokens = sum(int(m.sum()) for m in records[0]["loss_masks"])
    assert all(s["num_tokens"] == tokens for s in steps), (tokens, steps)
    assert steps[1]["loss"] < steps[0]["loss"], f"the PPO loss did not fall: {steps}"
    assert all(0 < s["grad_norm"] < float("inf") for s in steps), steps

    cfg = Qwen3MoeConfig.from_hf(tiny_checkpoint)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hf = read_hf_checkpoint(tiny_checkpoint, strict=False).tensors
    for rank, rec in enumerate(records):
        start = hf_to_megatron(cfg, hf, TRAIN_LAYOUT, rank, torch_dtype)
        params = rec["params"]
        assert all(p.dtype == torch_dtype for p in params.values())
        moved = {k: n_differ(params[k], start[k]) for k in params}
        frozen = [k for k, n in moved.items() if n == 0 and "local_experts" not in k]
        if dtype == "bf16":
            # Adam moves an element by about lr (1e-3) a step. The fp32 main params all move,
            # but the bf16 copy of a norm weight near 1 changes only past half an ulp (2^-8 or
            # 2^-9); the matrices (|w| ~ 0.1, half an ulp ~ 2^-12) must move.
            frozen = [k for k in frozen if params[k].dim() > 1]
        assert not frozen, f"{dtype} rank {rank}: tensors the step did not change: {frozen}"
        assert sum(n > 0 for n in moved.values()) > len(moved) // 2, moved
    # The DP replicas of each TP rank hold the same bits after the steps.
    for tp_rank in range(TRAIN_LAYOUT.tp):
        a, b = (r["params"] for r in records if r["coords"]["tp"] == tp_rank)
        for k in a:
            assert bitwise_equal(a[k], b[k]), (
                f"{dtype}: DP replicas of TP rank {tp_rank} differ at {k}: "
                f"{mismatch_report(a[k], b[k])}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_seeded_training_is_bitwise_reproducible(dtype, train_launches):
    first, second = (load_records(out / f"{dtype}-0") for out in train_launches)
    other_seed = load_records(train_launches[0] / f"{dtype}-1")
    for rank, (a, b, c) in enumerate(zip(first, second, other_seed, strict=True)):
        assert a["steps"] == b["steps"], (rank, a["steps"], b["steps"])
        for k, p in a["params"].items():
            assert bitwise_equal(p, b["params"][k]), (
                f"{dtype} rank {rank} {k}: {mismatch_report(p, b['params'][k])}"
            )
        # Control: the comparison sees a different batch's training.
        differ = sum(n_differ(p, c["params"][k]) for k, p in a["params"].items())
        assert differ > 0, f"{dtype} rank {rank}: seed 1 gave seed 0's bits"
