"""Evaluation during a run: the `[eval]` table and the metrics of a batch of eval samples.

Every `eval.every` steps (after that step's weight sync) and after the last step, the engines
sample each prompt of `data.eval_file` `eval.samples_per_prompt` times at `eval.temperature`
(0 is greedy), the task's reward scores them, and the step's metrics gain:

    eval/reward_mean     mean reward of the eval samples
    eval/pass@1          mean over prompts of the share of its samples that pass
    eval/pass@k          share of prompts with at least one passing sample, k =
                         eval.samples_per_prompt (also logged as eval/k)
    eval/truncated_frac  share of eval responses cut at max_new_tokens
    eval/prompts, eval/samples, time/eval_s

A sample passes when its reward is at least `eval.pass_threshold`. Eval samples are rolled out
with their own sampling seeds and never trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """When and how the run evaluates (the `[eval]` table; needs `data.eval_file`)."""

    every: int = 0
    """Evaluate after every N-th step; 0 only after the last step. Nothing without an eval file."""
    samples_per_prompt: int = 1
    """Samples per eval prompt: the k of eval/pass@k."""
    temperature: float = 0.0
    """Sampling temperature of the eval samples; 0 is greedy."""
    max_new_tokens: int = 0
    """Tokens generated per eval sample at most; 0 is grpo.max_new_tokens."""
    max_prompts: int = 0
    """Evaluate the first N prompts of the eval file; 0 all of them."""
    pass_threshold: float = 1.0
    """A sample whose reward is at least this passes (pass@k)."""


def eval_due(step: int, last_step: int, every: int) -> bool:
    """Whether the run evaluates after `step`."""
    return step == last_step or (every > 0 and step % every == 0)


def eval_metrics(
    rewards: list[float], n: int, threshold: float, truncated: list[bool]
) -> dict[str, float | int]:
    """The eval/ metrics of samples in groups of `n` (one group per prompt, in order)."""
    if n < 1 or not rewards or len(rewards) % n or len(truncated) != len(rewards):
        raise ValueError(
            f"eval_metrics: {len(rewards)} rewards, {len(truncated)} truncation "
            f"flags, groups of {n}"
        )
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    passed = [[r >= threshold for r in g] for g in groups]
    return {
        "eval/reward_mean": math.fsum(rewards) / len(rewards),
        "eval/pass@1": math.fsum(sum(p) / n for p in passed) / len(groups),
        "eval/pass@k": sum(any(p) for p in passed) / len(groups),
        "eval/k": n,
        "eval/truncated_frac": sum(truncated) / len(truncated),
        "eval/prompts": len(groups),
        "eval/samples": len(rewards),
    }
