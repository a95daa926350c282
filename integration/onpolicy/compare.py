"""Rollout log-probs against the trainer's log-probs of the same tokens: one comparison.

A rollout sample (a record of `onpolicy.rollout.engine.sample`: prompt, output_ids, logprobs)
and the trainer's fp32 log-probs of tokens 1..len-1 of prompt + output line up at the sample's
generated tokens; two log-probs are equal when their bits are (`onpolicy.bits`). `compare`
gives the verdict and the first differing token (`onpolicy parity`, the GRPO run's
true-on-policy assertion); `logprob_metrics` gives the GRPO step's metrics of the same pairs;
`format_table` prints verdicts, one row each.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from onpolicy.bits import as_bits, hex_bits


@dataclass(frozen=True, kw_only=True, slots=True)
class Mismatch:
    """The first generated token whose two log-probs differ in their bits."""

    sample: int
    """Index of the sample (prompt) in the rollout."""
    position: int
    """Position of the token in prompt + completion."""
    completion_index: int
    """Index of the token among the sample's generated tokens."""
    token: int
    """The token id."""
    rollout: torch.Tensor
    """The rollout engine's fp32 log-prob (a 0-d tensor, so its bits are kept)."""
    trainer: torch.Tensor
    """The trainer's fp32 log-prob."""

    def describe(self) -> str:
        return (
            f"first mismatch: sample {self.sample}, position {self.position} (generated token "
            f"{self.completion_index}), token id {self.token}: rollout "
            f"{float(self.rollout)!r} ({hex_bits(self.rollout)}) vs trainer "
            f"{float(self.trainer)!r} ({hex_bits(self.trainer)})"
        )


@dataclass(kw_only=True, slots=True)
class PairResult:
    """One comparison's verdict (a layout pair of `onpolicy parity`, a GRPO step)."""

    pair: str
    """The pair's name (ROLLOUT:TRAINING)."""
    compared: int
    """Generated tokens compared."""
    equal: int
    """Of those, tokens whose two log-probs have the same bits."""
    first: Mismatch | None = None
    """The first differing token, None when all are equal."""
    rows_compared: int = 0
    """Generated positions whose whole log-prob rows were compared by digest (0: not asked)."""
    rows_equal: int = 0
    """Of those, positions whose two row digests are equal."""
    first_row: str | None = None
    """The first position whose row digests differ, described."""

    @property
    def ok(self) -> bool:
        rows = self.rows_equal == self.rows_compared
        return self.compared > 0 and self.equal == self.compared and rows


def aligned(samples: list[dict], scores: Mapping[int, torch.Tensor], pair: str = ""
            ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per sample, in order: its index, its prompt length, the rollout's fp32 log-probs, the
    trainer's of the same tokens, and where the two have the same bits.

    `scores`: sample index -> the trainer's fp32 log-probs of tokens 1..len-1 of prompt +
    output. ValueError for a sample without scores, or scores of another dtype or length.
    """
    for i, s in enumerate(samples):
        if i not in scores:
            raise ValueError(f"{pair}: the trainer returned no scores for sample {i}")
        n_prompt = len(s["prompt"])
        got = torch.tensor(s["logprobs"], dtype=torch.float32)
        want = scores[i][n_prompt - 1 :]
        if want.dtype != torch.float32 or want.shape != got.shape:
            raise ValueError(
                f"{pair}: sample {i}: trainer log-probs are {want.dtype} {tuple(want.shape)}, "
                f"the rollout's float32 {tuple(got.shape)}"
            )
        yield i, n_prompt, got, want, as_bits(got) == as_bits(want)


def compare(samples: list[dict], scores: Mapping[int, torch.Tensor], pair: str = "") -> PairResult:
    """Each sample's rollout log-probs against the trainer's log-probs of the same tokens.

    `samples`: the rollout's records (prompt, output_ids, logprobs); `scores`: sample index ->
    the trainer's fp32 log-probs of tokens 1..len-1 of prompt + output.
    """
    compared = equal = 0
    first = None
    for i, n_prompt, got, want, same in aligned(samples, scores, pair):
        out = samples[i]["output_ids"]
        compared += len(out)
        equal += int(same.sum())
        if first is None and not bool(same.all()):
            j = int(torch.nonzero(~same)[0])
            first = Mismatch(sample=i, position=n_prompt + j, completion_index=j, token=out[j],
                             rollout=got[j], trainer=want[j])  # fmt: skip
    return PairResult(pair=pair, compared=compared, equal=equal, first=first)


def compare_rows(result: PairResult, samples: list[dict], digests: Mapping[int, torch.Tensor]
                 ) -> PairResult:  # fmt: skip
    """`result` with each generated position's whole-row digest compared: the rollout's
    (samples[i]["row_digests"], one per generated token, `rollout.digests`) against the
    trainer's (digests[i], int64 per position 0..len-2, `train.logprobs(digests=True)`)."""
    compared = equal = 0
    first = None
    for i, s in enumerate(samples):
        got, n_prompt = s["row_digests"], len(s["prompt"])
        want = digests[i][n_prompt - 1 :].tolist()
        if len(want) != len(got):
            raise ValueError(f"{result.pair}: sample {i}: {len(want)} trainer row digests for "
                             f"{len(got)} generated tokens")  # fmt: skip
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            compared += 1
            equal += a == b
            if a != b and first is None:
                first = (f"first row mismatch: sample {i}, position {n_prompt + j} (generated "
                         f"token {j}): rollout row digest {a & (2**64 - 1):#018x} vs trainer "
                         f"{b & (2**64 - 1):#018x}")  # fmt: skip
    result.rows_compared, result.rows_equal, result.first_row = compared, equal, first
    return result


def logprob_metrics(samples: list[dict], scores: Sequence[torch.Tensor]) -> dict[str, float]:
    """The rollout's log-probs against the trainer's, over every generated token (`scores[i]`
    scores sample i, as in `compare`).

    abs_diff = mean |train - rollout|; kl = mean (r - 1 - log r) with r = p_train / p_rollout,
    the k3 estimate of KL(rollout || train) on the rollout's own samples; both in float64, so
    they are 0.0 exactly when every pair is equal. equal_frac counts equal bits."""
    if len(scores) != len(samples):
        raise ValueError(f"logprob metrics: {len(scores)} trainer scores for {len(samples)} "
                         "samples")  # fmt: skip
    diffs, equal, total = [], 0, 0
    for _i, _n, got, want, same in aligned(samples, dict(enumerate(scores)), "logprob metrics"):
        equal += int(same.sum())
        total += len(got)
        diffs.append(want.double() - got.double())
    d = torch.cat(diffs)
    kl = torch.expm1(d) - d
    return {"train/train_rollout_logprob_abs_diff": float(d.abs().mean()),
            "train/train_rollout_kl": float(kl.mean()),
            "train/logprob_equal_frac": equal / total,
            "train/logprob_max_abs_diff": float(d.abs().max()),
            "train/tokens_compared": total}  # fmt: skip


def format_table(results: list[PairResult]) -> str:
    """One row per pair: equal / compared, then each mismatch's first differing token."""
    width = max([len("pair")] + [len(r.pair) for r in results])
    rows = any(r.rows_compared for r in results)
    head = f"{'rows equal / compared':>22}  " if rows else ""
    out = [f"{'pair'.ljust(width)}  {'equal / compared':>18}  {head}verdict"]
    for r in results:
        verdict = "bitwise equal" if r.ok else "DIFFER"
        cell = f"{f'{r.rows_equal} / {r.rows_compared}':>22}  " if rows else ""
        out.append(f"{r.pair.ljust(width)}  {f'{r.equal} / {r.compared}':>18}  {cell}{verdict}")
    for r in results:
        if r.first is not None:
            out.append(f"{r.pair}: {r.first.describe()}")
        if r.first_row is not None:
            out.append(f"{r.pair}: {r.first_row}")
    return "\n".join(out)
