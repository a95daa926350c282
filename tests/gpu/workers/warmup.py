"""One process, an empty Triton cache: the reference model (Qwen3-30B-A3B's layer dims, one
layer, bf16) scores the warm-up batches (`warmup_batches`, or only the largest with
`--largest-only`), then later batches: random ones and a few chosen (GEMM M of 3, 16 and 528).
Prints one JSON line: the warm-up's and the later batches' compiles, cache hits and seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch
from onpolicy.kernels.cuda.warmup import CompileLog, warm_up, warmup_batches
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B
from onpolicy.models.reference import Qwen3MoeReference

CFG = replace(QWEN3_30B_A3B, num_hidden_layers=1)


def later_batches(rng: random.Random, max_tokens: int) -> list[list[int]]:
    out = [[3], [16], [500, 28]]
    for _ in range(12):
        total, lengths = rng.randint(1, max_tokens), []
        while total > 0:
            n = min(total, rng.choice([1, 2, rng.randint(1, 64), rng.randint(1, max_tokens)]))
            lengths.append(n)
            total -= n
        out.append(lengths)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=1200)
    ap.add_argument("--largest-only", action="store_true")
    args = ap.parse_args()
    model = Qwen3MoeReference.random(CFG, dtype=torch.bfloat16, device="cuda", seed=0)
    gen = torch.Generator().manual_seed(0)

    def forward(lengths: list[int]) -> None:
        model.score([torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in lengths])
        torch.cuda.synchronize()

    g = CFG.num_attention_heads // CFG.num_key_value_heads
    batches = warmup_batches(args.max_tokens, CFG.num_experts_per_tok, g,
                             CFG.num_key_value_heads)  # fmt: skip
    if args.largest_only:
        batches = [[args.max_tokens]]
    warm = warm_up(forward, batches)
    log, t0 = CompileLog(), time.perf_counter()
    later = later_batches(random.Random(0), args.max_tokens)
    with log.counting("later"):
        for lengths in later:
            forward(lengths)
    seconds, compiles, hits = log.total()
    print(json.dumps({
        "warmup": {"batches": warm.batches, "seconds": round(warm.seconds, 2),
                   "compile_seconds": round(warm.compile_seconds, 2), "compiles": warm.compiles,
                   "hits": warm.cache_hits},
        "later": {"batches": len(later), "seconds": round(time.perf_counter() - t0, 2),
                  "compile_seconds": round(seconds, 2), "compiles": compiles, "hits": hits},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
