"""Megatron's per-token log-probs equal the reference model's `score`, bit for bit, at every layout.

Each layout is one torchrun launch (gloo) of workers/megatron_exact.py on the patched
megatron-core. In one process it scores a batch of mixed-length sequences in bf16 (the contract
dtype) and fp32 with the exact spec (`onpolicy.train.spec`, packed THD micro-batches through
`forward_only`, `onpolicy.train.logprobs`), and, as the negative control, with megatron-core's
stock local spec through the same schedule and the same sequences. Bits are compared as integer
views (`onpolicy.bits`) against `Qwen3MoeReference.score` on the same checkpoint.

Sizing: the test model is the tiny Qwen3-MoE with wider attention and experts, chosen so that the
contract accepts every layout below and the kernel rules call each of them exact
(`test_every_layout_is_exact_by_the_rules`):
- attention output K = 4 heads x 64 = 256 = 2 K-blocks: TP 2 gives each rank 1 whole block;
- expert down-projection K = moe_intermediate_size = 256 = 2 K-blocks: ETP 2 gives 1 each;
- vocab 1000 = 8 log-softmax segments of 125: TP 2 gives each rank 4 whole segments;
- hidden 128 (qkv, router, expert fc1 and LM head K; column-parallel, never split);
- 8 experts, top-4, so a token's combine sums 4 terms and its order matters.
ETP 2 is accepted by the contract (with rollout MoE TP = 2), so it is checked like the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from onpolicy.bits import assert_bitwise, n_differ
from onpolicy.contract.config import load_config
from onpolicy.contract.rules import k_segments, validate
from onpolicy.kernels import K_BLOCK, row_parallel_exact, vocab_parallel_exact
from onpolicy.layout import ParallelLayout
from onpolicy.models.tiny import tiny

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "workers" / "megatron_exact.py"
DIMS: dict[str, object] = {
    "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
    "vocab_size": 1000, "num_hidden_layers": 4,
}  # fmt: skip
CFG = tiny(**DIMS)
LENGTHS = [23, 5, 40, 2, 17, 33, 1, 12]
"""Mixed lengths; a length-1 sequence predicts nothing and must still be packed and skipped."""
MB_TOKENS = 64
"""Micro-batch token budget: 3 micro-batches at DP 1 (2 per replica at DP 2, one of them
empty), so PP runs a real pipeline and THD packs several sequences per micro-batch."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

LAYOUTS: dict[str, tuple[ParallelLayout, float]] = {
    "world1": (ParallelLayout(world=1), 1.0),
    "tp2-sp": (ParallelLayout(world=2, tp=2, sp=True), 0.7),
    "pp2": (ParallelLayout(world=2, pp=2), 1.0),
    "ep2": (ParallelLayout(world=2, ep=2), 0.7),
    "tp2-sp-etp2": (ParallelLayout(world=2, tp=2, sp=True, etp=2), 1.0),
    "dp2": (ParallelLayout(world=2), 0.7),
    "tp2-pp2-ep2-sp": (ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True), 0.7),
}
"""name -> (trainer layout, sampling temperature of the log-probs)."""


def contract_overrides(layout: ParallelLayout) -> dict[str, object]:
    """The tiny-cpu run config at this trainer layout, the test model's dims, and a colocated
    rollout whose MoE TP equals the layout's ETP."""
    over: dict[str, object] = {f"model.tiny.{k}": v for k, v in DIMS.items()}
    over.update({
        "training.world": layout.world, "training.tp": layout.tp, "training.pp": layout.pp,
        "training.ep": layout.ep, "training.etp": layout.etp, "training.sp": layout.sp,
        "rollout.tp": layout.tp, "rollout.ep": layout.tp // layout.etp,
        "rollout.engines": layout.world // layout.tp, "rollout.colocate": True,
    })  # fmt: skip
    return over


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_is_exact_by_the_rules(name):
    layout, _ = LAYOUTS[name]
    cfg = load_config(REPO / "configs" / "tiny-cpu.toml", contract_overrides(layout))
    validate(cfg)
    attn_k = CFG.num_attention_heads * CFG.head_dim
    # Multi-block trees, so a wrong split would show.
    assert attn_k > K_BLOCK and CFG.moe_intermediate_size > K_BLOCK
    # The run's S is each side's TP here (the rollout mirrors the trainer), which is also what
    # the workers take with ONPOLICY_K_SEGMENTS unset; the power-of-2 Ks make the reference's
    # unsplit tree (S = 1) the same bits on CPU.
    s = k_segments(cfg)
    assert (s.attention, s.experts) == (layout.tp, layout.etp), s
    assert row_parallel_exact(attn_k, layout.tp, s.attention), (attn_k, layout.tp)
    assert row_parallel_exact(CFG.moe_intermediate_size, layout.etp, s.experts)
    assert vocab_parallel_exact(CFG.vocab_size, layout.tp)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from onpolicy.models import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-wide", CFG, seed=0)


@pytest.fixture(scope="module")
def sequences(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    path = tmp_path_factory.mktemp("seqs") / "sequences.json"
    path.write_text(json.dumps(seqs))
    return path, seqs


@pytest.fixture(scope="module")
def reference(model_dir, sequences):
    """(dtype name, temperature) -> the reference model's per-sequence log-probs, computed once."""
    from onpolicy.models.reference import Qwen3MoeReference

    cache: dict[tuple[str, float], torch.Tensor] = {}

    def get(dtype: str, temperature: float) -> torch.Tensor:
        if (dtype, temperature) not in cache:
            model = Qwen3MoeReference.from_pretrained(model_dir, DTYPES[dtype])
            cache[dtype, temperature] = torch.cat(model.score(sequences[1], temperature))
        return cache[dtype, temperature]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprobs_equal_the_reference_bitwise(
    name, torchrun, model_dir, sequences, reference, tmp_path
):
    layout, temperature = LAYOUTS[name]
    torchrun(WORKER, layout.world, "--ckpt", str(model_dir), "--out", str(tmp_path),
                   "--sequences", str(sequences[0]), "--temperature", str(temperature),
                   "--mb-tokens", str(MB_TOKENS), *layout.cli_args())  # fmt: skip
    got = torch.load(tmp_path / "logprobs.pt")
    # The log-prob is also the training loss's input: its vocab-parallel gradient is torch's, up
    # to fp32 rounding (the gradients are O(1); a gradient missing or doubled on a shard is O(1)).
    assert got["grad_error"] < 1e-5, got["grad_error"]
    for dtype in DTYPES:
        ref = reference(dtype, temperature)
        exact = torch.cat(got[dtype]["exact"])
        assert [len(v) for v in got[dtype]["exact"]] == [max(n - 1, 0) for n in LENGTHS]
        # The claim: 100 % of tokens equal.
        assert_bitwise(exact, ref, f"{name} {dtype} exact spec vs reference")
        # The negative control: the stock local spec, same layout and sequences, differs:
        # Megatron's own log-probs (-cross-entropy), and the exact log-softmax of its logits.
        stock_ce = n_differ(torch.cat(got[dtype]["stock_ce"]), ref)
        stock_lsm = n_differ(torch.cat(got[dtype]["stock_logsoftmax"]), ref)
        print(f"{name} {dtype} T={temperature}: exact spec {ref.numel()}/{ref.numel()} tokens "
              f"equal; stock spec differs on {stock_ce}/{ref.numel()} (cross-entropy) and "
              f"{stock_lsm}/{ref.numel()} (its logits, exact log-softmax)")  # fmt: skip
        assert stock_ce > 0 and stock_lsm > 0, (name, dtype, stock_ce, stock_lsm)
