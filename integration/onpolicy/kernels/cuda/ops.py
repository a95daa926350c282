"""The CUDA backend's surface: the flat primitive names the dispatcher looks up
(`kernels._OPS`), the same set as `cpu/ops.py` and `kernels/native.py`. Compositions come from
`compose`, bound to this backend's kernels; with no kernel of its own, the expert-parallel merge
(a selection) is `compose`'s torch code."""

from functools import partial

from onpolicy.kernels import compose
from onpolicy.kernels.compose import merge_expert_parallel
from onpolicy.kernels.cuda.attention import attention, paged_attention
from onpolicy.kernels.cuda.elementwise import (
    embedding,
    kv_store,
    qk_norm_rope,
    rms_norm,
    rope,
    silu_mul,
)
from onpolicy.kernels.cuda.linear import linear, linear_partial
from onpolicy.kernels.cuda.logprob import (
    log_softmax,
    sumexp_partial,
    token_logprobs,
    vocab_parallel_token_logprobs,
)
from onpolicy.kernels.cuda.moe import combine, expert_outputs, route
from onpolicy.kernels.cuda.noise import uniform_noise

row_parallel_linear = partial(compose.row_parallel_linear, linear_partial)
moe = partial(compose.moe, route, expert_outputs, combine)

__all__ = [
    "attention", "combine", "embedding", "expert_outputs", "kv_store", "linear", "linear_partial",
    "log_softmax", "merge_expert_parallel", "moe", "paged_attention", "qk_norm_rope",
    "rms_norm", "rope", "route", "row_parallel_linear", "silu_mul", "sumexp_partial",
    "token_logprobs", "uniform_noise", "vocab_parallel_token_logprobs",
]  # fmt: skip
