"""The exact path's sampler: `onpolicy.models.reference.sample`, row by row, inside SGLang.

Each request draws its Gumbel noise from its own generator, seeded by
`reference.request_seed(sampling_seed, 0, step)` where step counts the tokens it has already
generated, so the draw does not depend on the batch, the TP rank or the device. The returned
log-prob is `kernels.token_logprobs` of logits / T in the model dtype: the function the
reference's `score` uses, so decode == score holds bit for bit. Greedy requests (SGLang's
top_k = 1) take the first argmax, with the log-prob at T = 1.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.sampler import Sampler

from onpolicy import kernels as K
from onpolicy.models import reference


def _refuse(problem: str) -> None:
    raise NotImplementedError(f"onpolicy sampler: {problem}; the exact path samples the full "
                              "distribution (temperature only) or greedily")  # fmt: skip


class OnpolicySampler(Sampler):
    """SGLang's `Sampler` with its forward replaced by the reference's sampling rule."""

    def __init__(self) -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_server_args

        self.model_dtype = getattr(torch, get_server_args().dtype)

    def _check(self, sampling_info, logprob_logits) -> None:
        if logprob_logits is not None or sampling_info.has_custom_logit_processor:
            _refuse("watermarks and custom logit processors change the logits")
        if sampling_info.sampling_mask_batch_indices is not None:
            _refuse("return_sampling_mask is not supported")
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
        tokens, lps, temps_used = [], [], []
        for i, row in enumerate(logits):
            greedy = top_ks[i] == 1
            if not greedy and (top_ks[i] < vocab or top_ps[i] < 1.0 or min_ps[i] > 0.0):
                _refuse(f"row {i} asks top_k={top_ks[i]}, top_p={top_ps[i]}, min_p={min_ps[i]}")
            req = reference.Request(
                rid=0,
                prompt=[],
                temperature=0.0 if greedy else temps[i],
                seed=int(seeds[i]),
                output=[0] * max(0, int(steps[i])),
            )
            token, lp = reference.sample(row, req)
            tokens.append(token)
            lps.append(lp)
            temps_used.append(1.0 if greedy else temps[i])
        ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        if return_logprob:
            wants_rows = any(n > 0 for n in top_logprobs_nums) or any(
                t is not None for t in token_ids_logprobs
            )
            if wants_rows:  # whole rows for top-k / listed ids; the same op per row
                rows = torch.stack([K.log_softmax(K.scale_logits(r, t))
                                    for r, t in zip(logits, temps_used, strict=True)])  # fmt: skip
                res = self.output_logprob_processor.compute_logprobs(
                    rows, top_logprobs_nums, token_ids_logprobs, ids
                )
                res.write_output_to(logits_output)
            logits_output.next_token_logprobs = torch.tensor(lps, dtype=torch.float32,
                                                             device=logits.device)  # fmt: skip
        return ids


def create_sampler() -> Sampler:
    """The sampler SGLang's `create_sampler` returns when the switch is on."""
    return OnpolicySampler()
