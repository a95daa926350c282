"""The exact path's sampler: `onpolicy.models.sampling.sample_rows` over the batch, inside
SGLang.

Each request's Gumbel noise is keyed by `sampling.noise_key(sampling_seed, 0, step)` where step
counts the tokens it has already generated, so it does not depend on the batch, the TP rank or
the device; it is made on the logits' device for the whole batch at once. The returned log-prob
is `kernels.token_logprobs` of logits / T in the model dtype: the function the reference's
`score` uses, so decode == score holds bit for bit. Greedy requests (SGLang's top_k = 1) take
the first argmax, with the log-prob at T = 1. Tokens and log-probs stay on the device: the
sampler reads only the batch's small per-row settings back to the host.

`check_sampling_params` is that rule for one request: the tokenizer manager runs it at request
validation (so a request outside it is refused before it reaches the scheduler) and the sampler
runs it again per row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from sglang.srt.layers.sampler import Sampler

from onpolicy import bits
from onpolicy.models import sampling
from onpolicy.rollout import digests

FULL = "the exact path samples from the full distribution (top_p 1, top_k -1, min_p 0)"
"""What the reference's sampling rule allows: temperature only, or greedy (top_k 1)."""


LOGIT_NEUTRAL: dict[str, float] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}  # fmt: skip
"""Sampling settings that edit the logits, at the value that leaves them unchanged."""
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
"""Constrained-decoding settings: each masks the logits by a grammar."""


def _refuse(problem: str, why: str = FULL) -> None:
    raise ValueError(f"onpolicy sampling: {problem}; {why}")


class RowParams(NamedTuple):
    """One batch row's truncation settings, as the sampler sees them."""

    top_k: int
    """SGLang's top_k: 1 is greedy, -1 or >= vocab_size the whole vocabulary."""
    top_p: float
    """Nucleus mass; only 1 is on the rule."""
    min_p: float
    """Minimum probability relative to the top token; only 0 is on the rule."""


def check_sampling_params(
    params: Any,
    vocab_size: int,
    *,
    custom_logit_processor: Any = None,
    return_sampling_mask: bool = False,
    watermark: bool = False,
) -> None:
    """Raise ValueError naming the first setting outside the reference's sampling rule.

    `params` is anything with top_k / top_p / min_p (SGLang's SamplingParams or a RowParams);
    the logit edits (penalties, min_new_tokens, logit_bias, grammars) are read where present.
    """
    if watermark:
        _refuse("watermark is on", "a watermark changes the sampled logits")
    if custom_logit_processor:
        _refuse("custom_logit_processor is set", "a logit processor changes the sampled logits")
    if return_sampling_mask:
        _refuse("return_sampling_mask is true", "the exact path keeps no sampling mask")
    # These edit the logits before sampling (greedy included), so the returned log-prob would no
    # longer be the model's log_softmax(logits / T) that the trainer scores.
    edits = "it edits the logits before sampling, so the log-prob would not be the model's"
    for name, neutral in LOGIT_NEUTRAL.items():
        value = getattr(params, name, neutral)
        if value != neutral:
            _refuse(f"{name} = {value}", f"{edits} (only {name} = {neutral} is on the rule)")
    if getattr(params, "logit_bias", None):
        _refuse(f"logit_bias = {params.logit_bias}", edits)
    for name in GRAMMARS:
        if getattr(params, name, None):
            _refuse(f"{name} is set", f"a grammar masks the logits; {edits}")
    if params.top_k == 1:  # greedy: truncation never drops the argmax, so it changes nothing
        return
    if params.top_p != 1.0:
        _refuse(f"top_p = {params.top_p}")
    if params.min_p != 0.0:
        _refuse(f"min_p = {params.min_p}")
    if 0 < params.top_k < vocab_size:  # -1 (TOP_K_ALL after SGLang's parsing) is the full vocab
        _refuse(f"top_k = {params.top_k}")


class OnpolicySampler(Sampler):
    """SGLang's `Sampler` with its forward replaced by the reference's sampling rule."""

    def __init__(self) -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_server_args

        self.model_dtype = getattr(torch, get_server_args().dtype)
        self.digests = digests.folder()

    def _check(self, sampling_info, logprob_logits) -> None:
        check_sampling_params(RowParams(1, 1.0, 0.0), 1,
                              custom_logit_processor=sampling_info.has_custom_logit_processor,
                              return_sampling_mask=sampling_info.sampling_mask_batch_indices
                              is not None, watermark=logprob_logits is not None)  # fmt: skip
        if sampling_info.prompt_lens is None or sampling_info.sampling_seed is None:
            raise RuntimeError("onpolicy sampler: the batch carries no seeds / prompt lengths "
                               "(is the sampling patch applied?)")  # fmt: skip

    def forward(self, logits_output, sampling_info, return_logprob: bool,
                top_logprobs_nums, token_ids_logprobs, positions: torch.Tensor, *,
                logprob_logits=None) -> torch.Tensor:  # fmt: skip
        self._check(sampling_info, logprob_logits)
        logits = logits_output.next_token_logits.to(self.model_dtype)  # exact: came from it
        vocab = logits.shape[-1]
        temps = sampling_info.temperatures.view(-1).tolist()
        top_ks = sampling_info.top_ks.view(-1).tolist()
        top_ps = sampling_info.top_ps.view(-1).tolist()
        min_ps = sampling_info.min_ps.view(-1).tolist()
        seeds = sampling_info.sampling_seed.view(-1).tolist()
        steps = (positions.view(-1) + 1 - sampling_info.prompt_lens.view(-1)).tolist()
        for k, p, m in zip(top_ks, top_ps, min_ps, strict=True):
            check_sampling_params(RowParams(k, p, m), vocab)
        # SGLang's greedy is top_k 1 at any temperature; the rule's greedy is temperature 0.
        temps_used = [0.0 if k == 1 else t for k, t in zip(top_ks, temps, strict=True)]
        keys = [sampling.noise_key(int(seed), 0, max(0, int(step)))
                for seed, step in zip(seeds, steps, strict=True)]  # fmt: skip
        ids, lps = sampling.sample_rows(logits, temps_used, keys)
        rows = None
        if self.digests is not None:
            rows = sampling.log_softmax_rows(logits, temps_used)
            from sglang.srt.distributed.parallel_state import get_tp_group

            rank = get_tp_group().rank_in_group
            digests.record(self.digests, rank, seeds, steps, bits.row_digests(rows))
        if return_logprob:
            wants_rows = any(n > 0 for n in top_logprobs_nums) or any(
                t is not None for t in token_ids_logprobs
            )
            if wants_rows:  # whole rows for top-k / listed ids; the same op per row
                rows = sampling.log_softmax_rows(logits, temps_used) if rows is None else rows
                res = self.output_logprob_processor.compute_logprobs(
                    rows, top_logprobs_nums, token_ids_logprobs, ids
                )
                res.write_output_to(logits_output)
            logits_output.next_token_logprobs = lps
        return ids


def create_sampler() -> Sampler:
    """The sampler SGLang's `create_sampler` returns when the switch is on."""
    return OnpolicySampler()
