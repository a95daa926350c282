"""Full-size prefill == decode: the reference model at Qwen3-30B-A3B's shape, on one GPU.

Random seeded bf16 weights at the published dims (48 layers, 128 experts top-8, hidden 2048,
vocab 151936) are made on the device. A batch of requests with mixed prompt lengths is
generated with chunked prefill and paged decode; then every sequence is scored by packed
prefill. Each generated token's decode log-prob must equal its score log-prob bit for bit.
With `--native` the same run uses the plain torch ops instead: the control that shows the
check can fail.

    python -m onpolicy.bench.fullsize [--layers 48] [--requests 8] [--new-tokens 16] [--native]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from onpolicy import kernels as K
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B, Qwen3MoeConfig
from onpolicy.models.reference import Qwen3MoeReference

PROMPT_LENGTHS = (1, 7, 33, 64, 65, 129, 300, 517, 1000, 2049)
"""Prompt lengths, cycled: block and chunk edges (64, 65), one token, and long prompts."""


@dataclass(kw_only=True, slots=True)
class Result:
    """What one full-size run compared."""

    layers: int
    """Decoder layers the model had."""
    prompt_lengths: list[int]
    """Prompt length of each request."""
    tokens: int
    """Generated tokens compared (decode log-prob vs score log-prob)."""
    equal: int
    """Of those, how many were bit-identical."""
    generate_s: float
    """Wall time of chunked prefill plus decode."""
    score_s: float
    """Wall time of the packed-prefill scoring."""
    native: bool
    """Whether the plain torch ops ran instead of the exact ones."""

    def line(self) -> str:
        ops = "native torch ops" if self.native else "exact ops"
        return (
            f"{ops}: {self.equal}/{self.tokens} generated tokens bit-identical "
            f"({100 * self.equal / max(self.tokens, 1):.1f} %), {self.layers} layers, "
            f"prompts {self.prompt_lengths}, generate {self.generate_s:.1f} s, "
            f"score {self.score_s:.1f} s"
        )


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def run(
    cfg: Qwen3MoeConfig = QWEN3_30B_A3B, *, requests: int = 8, new_tokens: int = 16,
    chunk_size: int = 256, seed: int = 0, native: bool = False, device: str = "cuda",
    model: Qwen3MoeReference | None = None,
) -> Result:  # fmt: skip
    """Generate, score, and count the generated tokens whose two log-probs are identical."""
    model = model or Qwen3MoeReference.random(cfg, dtype=torch.bfloat16, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(requests)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    ops = K.native_ops() if native else contextlib.nullcontext()
    with ops:
        t0 = time.perf_counter()
        reqs = model.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seed,
                              chunk_size=chunk_size)  # fmt: skip
        _sync(device)
        t1 = time.perf_counter()
        scored = model.score([r.prompt + r.output for r in reqs])
        _sync(device)
        t2 = time.perf_counter()
    tokens = equal = 0
    for r, s in zip(reqs, scored, strict=True):
        decoded = torch.tensor(r.logprobs, dtype=torch.float32)
        prefilled = s[len(r.prompt) - 1 :].cpu()
        tokens += decoded.numel()
        equal += int((decoded.view(torch.int32) == prefilled.view(torch.int32)).sum())
    return Result(layers=cfg.num_hidden_layers, prompt_lengths=lengths, tokens=tokens,
                  equal=equal, generate_s=t1 - t0, score_s=t2 - t1, native=native)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=QWEN3_30B_A3B.num_hidden_layers)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--native", action="store_true", help="also run the plain-torch control")
    ap.add_argument("--out", help="append the result as a dated section to this markdown file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("onpolicy.bench.fullsize needs a CUDA device (the model is ~61 GB)")
    cfg = dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    model = Qwen3MoeReference.random(cfg, dtype=torch.bfloat16, device="cuda", seed=0)
    gib = sum(p.numel() for p in model.parameters()) * 2 / 2**30
    head = (
        f"## Full-size prefill == decode, {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{torch.cuda.get_device_name()}\n\nQwen3-30B-A3B shape, {cfg.num_hidden_layers} layers, "
        f"random bf16 weights ({gib:.1f} GiB); torch {torch.__version__}; "
        f"`python -m onpolicy.bench.fullsize{' --native' if args.native else ''}`\n"
    )
    print(head, flush=True)
    lines = []
    for native in (False, True) if args.native else (False,):
        res = run(cfg, requests=args.requests, new_tokens=args.new_tokens, native=native,
                  model=model)  # fmt: skip
        lines.append(f"- {res.line()}")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + head + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
