"""The op names the dispatcher looks up for CUDA tensors."""

from onpolicy.kernels.cuda.attention import attention, paged_attention
from onpolicy.kernels.cuda.elementwise import embedding, rms_norm, rope, silu_mul
from onpolicy.kernels.cuda.linear import linear, linear_partial, row_parallel_linear
from onpolicy.kernels.cuda.logprob import (
    log_softmax,
    sumexp_partial,
    token_logprobs,
    vocab_parallel_token_logprobs,
)
from onpolicy.kernels.cuda.moe import combine, expert_outputs, merge_expert_parallel, moe, route

__all__ = [
    "attention", "combine", "embedding", "expert_outputs", "linear", "linear_partial",
    "log_softmax", "merge_expert_parallel", "moe", "paged_attention", "rms_norm", "rope",
    "route", "row_parallel_linear", "silu_mul", "sumexp_partial", "token_logprobs",
    "vocab_parallel_token_logprobs",
]  # fmt: skip
