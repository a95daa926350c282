"""One exact SGLang engine on CUDA in this process (its own: `Engine.shutdown()` kills the
descendants of the process that made it), Triton's cache in TRITON_CACHE_DIR, empty at start:
`launch` (its warm-up on, or off with `--no-warm-up`), the kernels then in the cache, a workload
of co-batched prompts of varied lengths, and the kernels the workload added. Prints one JSON
line: {"launch_s", "kernels_after_launch", "workload", "new": [kernel names]}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from onpolicy.rollout.engine import RolloutRequest, launch, sample

LENGTHS = (1, 2049, 300, 17, 1024, 5, 64, 2, 700, 33, 128, 9, 1500, 3, 257, 40)
"""tests/gpu/test_sglang_cuda.py's prompt lengths: one co-batched rollout."""
NEW_TOKENS = 8
"""Tokens each workload prompt generates."""
MAX_BATCH = 16
"""Prompts in the workload's largest batch: the decode graphs are captured up to it, as
`onpolicy.parity.rollout_worker` captures them up to its batch."""


def kernels(cache: Path) -> dict[str, str]:
    """Triton's compiled kernels in `cache`: its folder -> the kernel's name. Triton writes one
    folder a compile, holding `<name>.json` (its metadata) beside the binaries; the group file
    (`__grp__<name>.json`) and folders of compiled launchers hold no kernel."""
    found = {}
    for d in sorted(cache.iterdir()) if cache.is_dir() else []:
        names = [f.stem for f in d.glob("*.json") if not f.name.startswith("__grp__")]
        if names:
            found[d.name] = names[0]
    return found


def workload(rng: random.Random, vocab: int) -> list[list[list[int]]]:
    """LENGTHS as one batch, then seeded random batches of 1 to MAX_BATCH prompts: one or two
    tokens, a few dozen, or up to 3000 (one prompt above attention's split bound)."""
    shapes = [list(LENGTHS), [3000]]
    for _ in range(6):
        shapes.append([rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 2049)])
                       for _ in range(rng.randint(1, MAX_BATCH))])  # fmt: skip
    return [[[rng.randrange(vocab) for _ in range(n)] for n in s] for s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--no-warm-up", action="store_true")
    args = ap.parse_args()
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    t0 = time.perf_counter()
    engine = launch(args.ckpt, device="cuda", warm_up=not args.no_warm_up,
                    cuda_graph_max_bs_decode=MAX_BATCH)  # fmt: skip
    launch_s = time.perf_counter() - t0
    try:
        before = kernels(cache)
        vocab = engine.tokenizer_manager.model_config.hf_text_config.vocab_size
        batches, t0 = workload(random.Random(0), vocab), time.perf_counter()
        for i, prompts in enumerate(batches):  # sampled at 1.0 and 0.7, and greedy
            req = RolloutRequest(prompts=prompts, new_tokens=NEW_TOKENS,
                                 temperature=(1.0, 0.7, 0.0)[i % 3], seed=100 * i)  # fmt: skip
            sample(engine, req)
        seconds = time.perf_counter() - t0
        new = {k: v for k, v in kernels(cache).items() if k not in before}
    finally:
        engine.shutdown()
    print(json.dumps({
        "launch_s": round(launch_s, 1), "kernels_after_launch": len(before),
        "workload": {"batches": len(batches), "prompts": sum(map(len, batches)),
                     "tokens": sum(len(p) for b in batches for p in b),
                     "seconds": round(seconds, 1)},
        "new": sorted(new.values()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
