"""The CPU backend's surface: the flat primitive names the dispatcher looks up (`kernels._OPS`),
the same set as `cuda/ops.py` and `kernels/native.py`. Compositions come from `compose`, bound
to this backend's primitives; `compose`'s combine, expert-parallel merge and KV store are plain
torch and serve as this backend's own."""

from functools import partial

from onpolicy.kernels import compose
from onpolicy.kernels.compose import combine, kv_store, merge_expert_parallel
from onpolicy.kernels.cpu.activation import embedding, silu_mul
from onpolicy.kernels.cpu.attention import attention, paged_attention
from onpolicy.kernels.cpu.linear import linear, linear_partial
from onpolicy.kernels.cpu.logprob import log_softmax, sumexp_partial, token_logprobs
from onpolicy.kernels.cpu.moe import expert_outputs, route
from onpolicy.kernels.cpu.noise import uniform_noise
from onpolicy.kernels.cpu.norm import rms_norm
from onpolicy.kernels.cpu.rope import rope

row_parallel_linear = partial(compose.row_parallel_linear, linear_partial)
vocab_parallel_token_logprobs = partial(compose.vocab_parallel_token_logprobs, sumexp_partial)
moe = partial(compose.moe, route, expert_outputs, combine)
qk_norm_rope = partial(compose.qk_norm_rope, rms_norm, rope)

__all__ = [
    "attention", "combine", "embedding", "expert_outputs", "kv_store", "linear", "linear_partial",
    "log_softmax", "merge_expert_parallel", "moe", "paged_attention", "qk_norm_rope",
    "rms_norm", "rope", "route", "row_parallel_linear", "silu_mul", "sumexp_partial",
    "token_logprobs", "uniform_noise", "vocab_parallel_token_logprobs",
]  # fmt: skip
