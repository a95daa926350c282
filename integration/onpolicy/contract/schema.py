"""`qwen3_moe_true_on_policy_v1`: what trainer and rollout agree on for bit-equal log-probs.

Every field here is read by a rule (contract/rules.py). The exact op each numeric step goes
through, and its reduction order, is not restated here: it is `onpolicy.kernels` itself, and
docs/exactness.md describes it op by op.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    """A true-on-policy contract: model family, dtypes and the parallel dims it pins."""

    name: str
    """The contract id both engines are launched with."""
    model_family: str
    """The only model family the kernels and weight mapping cover."""
    param_dtype: str
    """Weights and activations between ops."""
    accum_dtype: str
    """Accumulation inside every exact op and every collective sum."""
    fixed_dims: tuple[tuple[str, object, str], ...] = (
        ("training.cp", 1, "context parallel splits a sequence's attention sum across ranks"),
        ("rollout.dp_attention", False,
         "SGLang's attention data-parallel splits the batch and changes the attention reduction"),
    )  # fmt: skip
    """(config key, the value it is pinned to, why): dims the contract does not allow to move."""
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
