"""`qwen3_moe_true_on_policy_v1`: what trainer and rollout agree on for bit-equal log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelChoices:
    """The exact op each numeric step goes through, on both sides (see docs/exactness.md)."""

    matmul: str = "tree_k128"
    """Rows independent of M; K in 128-wide blocks summed by the pairwise tree; fp32 accumulate."""
    attention: str = "fixed_block_online_softmax"
    """Keys in fixed-size blocks in a fixed order; the same arithmetic for prefill and decode."""
    rmsnorm: str = "fp32_row"
    """fp32 math one row at a time; cast before the weight multiply."""
    rope: str = "fp32_neox"
    """Neox-style rotary embedding with fp32 cos/sin, not fused."""
    moe_router: str = "fp32_softmax_stable_topk"
    """Router GEMM, fp32 softmax, stable top-k with lower-id tie-break, renormalise."""
    moe_combine: str = "expert_id_tree"
    """A token's weighted expert outputs summed by the pairwise tree in expert-id order."""
    tp_all_reduce: str = "gather_tree"
    """All-gather the fp32 partials, then the pairwise tree in rank order."""
    sp_reduce_scatter: str = "all_to_all_tree"
    """All-to-all of per-shard partials, then the local tree: the all-reduce's slice."""
    ep_dispatch: str = "all_to_all_expert_order"
    """Token rows to their experts' EP ranks and back by all-to-all, in expert-id order."""
    log_softmax: str = "fp32_row"
    """Batch-invariant log-softmax, one row at a time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobContract:
    """How a per-token log-prob is defined; SGLang's prefill path is the reference."""

    name: str = "sglang_prefill"
    """The rollout engine's prefill log-prob defines the numbers; the trainer reproduces it."""
    temperature: str = "divide_logits_unless_1"
    """Logits are divided by the temperature only when it is not 1."""
    logits_dtype: str = "bfloat16"
    """Logits are cast to this dtype before the log-softmax."""
    stored_dtype: str = "bfloat16"
    """Rollout log-probs are stored in this dtype."""
    vocab: str = "truncate_after_tp_gather"
    """The LM head's padded vocab is cut to the real vocab after the TP gather."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    """A true-on-policy contract: model family, dtypes, kernels, log-prob rule, parallel dims."""

    name: str
    """The contract id both engines are launched with."""
    model_family: str
    """The only model family the kernels and weight mapping cover."""
    param_dtype: str
    """Weights and activations between ops."""
    accum_dtype: str
    """Accumulation inside every exact op and every collective sum."""
    kernels: KernelChoices = field(default_factory=KernelChoices)
    """The exact op for each step."""
    logprob: LogprobContract = field(default_factory=LogprobContract)
    """The definition of a log-prob."""
    training_dims: tuple[str, ...] = ("tp", "pp", "ep", "etp", "sp", "dp")
    """Megatron parallel dims a layout may set; everything else stays at its default."""
    rollout_dims: tuple[str, ...] = ("engines", "tp", "ep")
    """SGLang parallel dims a layout may set (MoE TP is tp / ep)."""
    fixed_dims: tuple[tuple[str, object], ...] = (
        ("training.cp", 1),
        ("rollout.dp_attention", False),
    )
    """Dims the contract pins: context parallel and SGLang attention data-parallel stay off."""
    power_of_2_groups: tuple[str, ...] = (
        "training.tp", "training.pp", "training.ep", "training.etp", "training.dp",
        "rollout.tp", "rollout.ep",
    )  # fmt: skip
    """Groups whose sizes must be powers of 2 for the tree sums to stay layout-invariant."""


QWEN3_MOE_TRUE_ON_POLICY_V1 = Contract(
    name="qwen3_moe_true_on_policy_v1",
    model_family="qwen3_moe",
    param_dtype="bfloat16",
    accum_dtype="float32",
)
