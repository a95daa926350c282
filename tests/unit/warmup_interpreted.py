"""The warm-up batches launch every Triton variant that random batches launch, checked on the CPU
with Triton's interpreter in place of the GPU (run as a script with TRITON_INTERPRET=1; the
test does so in a subprocess).

A variant is keyed as the GPU's JIT keys it: the kernel, its constexprs, its launch options,
and Triton's own specialization of every other argument (`native_specialize_impl`, honouring
the kernel's `do_not_specialize`). Every launch is recorded and none is run: values decide no
variant. Only the router's expert ids are written (valid ids), since they index the MoE's
schedule.
A tiny reference model scores packed batches through the CUDA backend (on CPU tensors): first
the warm-up batches, then random batches of at most a case's max tokens, whose keys must all be
among the warm-up's. Negative controls: a warm-up of only the largest batch misses keys, and so
does the full warm-up once the GEMM's M is specialized again.

Prints one JSON line: the key counts and the keys each check missed.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
from onpolicy import kernels  # noqa: E402
from onpolicy.kernels.cuda import linear  # noqa: E402
from onpolicy.kernels.cuda import ops as cuda_ops  # noqa: E402
from onpolicy.kernels.cuda.warmup import warm_up, warmup_batches  # noqa: E402
from onpolicy.models.reference import Qwen3MoeReference  # noqa: E402
from onpolicy.models.tiny import tiny  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

RANDOM_BATCHES = 300

KEYS: set[tuple] = set()


def key(kernel: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    """The JIT's cache key of one launch, less the device and the source (fixed here)."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    dns = kernel.kwargs.get("do_not_specialize") or ()
    bound = dict(zip((p.name for p in params), args, strict=False))
    bound |= {k: v for k, v in kwargs.items() if k in {p.name for p in params}}
    parts = []
    for i, p in enumerate(params):
        if p.name not in bound:
            continue
        v = bound[p.name]
        if "constexpr" in str(p.annotation):
            parts.append((p.name, repr(v)))
        else:
            free = i in dns or p.name in dns
            parts.append((p.name, repr(native_specialize_impl(BaseBackend, v, False, not free,
                                                              True))))  # fmt: skip
    options = sorted((k, repr(v)) for k, v in kwargs.items() if k not in bound)
    return (kernel.fn.__name__, tuple(parts), tuple(options))


def install() -> None:
    def recorded(self, *args, grid, warmup, **kwargs):
        KEYS.add(key(self, args, kwargs))
        if self.fn.__name__ == "_route_kernel":  # ids [T, k]: valid and distinct per token
            ids = args[1]
            ids.copy_(torch.arange(ids.numel()).view_as(ids) % kwargs["E"])
        return None

    InterpretedFunction.run = recorded
    kernels._loaded["cpu"] = cuda_ops  # the CUDA backend's kernels on CPU tensors


def keys_of(model: Qwen3MoeReference, batches: list[list[int]]) -> set[tuple]:
    """The variant keys that scoring `batches` launches, through `warm_up`."""
    gen = torch.Generator().manual_seed(0)

    def forward(lengths: list[int]) -> None:
        model.score([torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
                     for n in lengths])  # fmt: skip

    KEYS.clear()
    warm_up(forward, batches)
    return set(KEYS)


def later_batches(rng: random.Random, max_tokens: int, min_len: int = 1) -> list[list[int]]:
    """Random batches of sequences of at least `min_len` tokens, and three chosen ones: a GEMM
    M of 16 and of 528 (multiples of 16, in TINY_M and at LARGE M) and of 3."""
    out = [[16], [500, 28], [3]]
    for _ in range(RANDOM_BATCHES):
        total, lengths = rng.randint(min_len, max_tokens), []
        while total >= min_len:
            n = min(total, rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, max_tokens)]))
            n = max(n, min_len)
            if total - n < min_len:
                n = total  # no shorter sequence left behind
            lengths.append(n)
            total -= n
        out.append(lengths)
    return out


CASES = {
    "gqa2": (dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2), 600),
    "qwen3-30b-heads": (dict(num_attention_heads=32, num_key_value_heads=4, num_experts=16,
                             num_experts_per_tok=8), 2600),
    "trainer": (dict(num_attention_heads=32, num_key_value_heads=4, num_experts=16,
                     num_experts_per_tok=8), 1500, 2),
    "fp32": (dict(num_attention_heads=32, num_key_value_heads=4, num_experts=16,
                  num_experts_per_tok=8), 1500, 2, torch.float32),
}  # fmt: skip
"""name -> (the tiny model's head and expert counts, max tokens[, shortest sequence[, dtype]]).
The second has Qwen3-30B-A3B's heads and top-8, and a max past the last token count whose
prefill splits its partitions; the third scores sequences of 2 tokens or more, as a trainer
does; the fourth is the third in fp32 (attention's fp32 tile)."""


def case(dims: dict, max_tokens: int, min_len: int = 1, dtype=torch.bfloat16) -> dict:
    cfg = tiny(hidden_size=64, head_dim=16, moe_intermediate_size=32, vocab_size=128,
               num_hidden_layers=1, **dims)  # fmt: skip
    model = Qwen3MoeReference.random(cfg, dtype=dtype)
    g, hkv = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads
    batches = warmup_batches(max_tokens, cfg.num_experts_per_tok, g, hkv, min_len,
                             fp32=dtype == torch.float32)  # fmt: skip
    linear._mm_kernel.kwargs["do_not_specialize"] = ["M"]
    warm = keys_of(model, batches)
    later = keys_of(model, later_batches(random.Random(0), max_tokens, min_len))
    only_max = keys_of(model, [[max_tokens]])
    linear._mm_kernel.kwargs["do_not_specialize"] = []  # M specialized again
    warm_spec = keys_of(model, batches)
    later_spec = keys_of(model, later_batches(random.Random(0), max_tokens, min_len))
    return {
        "warmup_batches": len(batches), "warm": len(warm), "later": len(later),
        "missed": sorted(map(repr, later - warm)),
        "missed_by_largest_only": len(later - only_max),
        "missed_when_m_specialized": len(later_spec - warm_spec),
    }  # fmt: skip


def main() -> None:
    install()
    print(json.dumps({name: case(*c) for name, c in CASES.items()}))


if __name__ == "__main__":
    sys.exit(main())
