"""The rollout side of `onpolicy parity`: one SGLang engine samples prompts, with log-probs.

`python -m onpolicy.parity.rollout_worker --ckpt DIR --request FILE --out FILE [--tp N]
[--ep N] [--dtype D] [--stock] [--device cuda [--eager]]` runs in its own process:
SGLANG_USE_CPU_ENGINE must be set before sglang is imported
(`onpolicy.rollout.engine.engine_env`), and `Engine.shutdown()` kills every descendant of the
process that made the engine, so the engine never lives in the driver. It reads a
`RolloutRequest` (JSON), starts the engine (`launch`), samples (`sample`) and writes
{"request", "samples", "sglang", "decode_graphs"} (JSON; "decode_graphs" is the decode
CUDA-graph backend the engine resolved).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from onpolicy.rollout import digests
from onpolicy.rollout.engine import RolloutRequest, launch, sample, sglang_origin
from onpolicy.rollout.switch import graph_backends


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.parity.rollout_worker",
                                 description=__doc__)  # fmt: skip
    ap.add_argument("--ckpt", required=True, help="HF checkpoint folder")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stock", action="store_true", help="SGLang's stock path, not the exact")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--eager", action="store_true",
                    help="CUDA: decode without CUDA graphs (the graphs' control)")  # fmt: skip
    ap.add_argument("--request", required=True, help="JSON file of a RolloutRequest")
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    ap.add_argument("--row-digests", metavar="DIR",
                    help="folder for the sampler's row digests")  # fmt: skip
    args = ap.parse_args(argv)
    req = RolloutRequest(**json.loads(Path(args.request).read_text()))
    if args.row_digests:  # the engine's scheduler processes inherit it
        Path(args.row_digests).mkdir(parents=True, exist_ok=True)
        os.environ[digests.ENV] = args.row_digests
    # Graphs only at batch sizes this request can reach: capturing SGLang's 36 sizes up to 256
    # took a minute on an H100.
    graphs = {"disable_cuda_graph": True} if args.eager else {}
    if args.device == "cuda" and not args.eager:
        graphs = {"cuda_graph_max_bs_decode": len(req.prompts)}
    engine = launch(args.ckpt, args.tp, args.ep, args.dtype, exact=not args.stock,
                    device=args.device, **graphs)  # fmt: skip
    try:
        samples = sample(engine, req)
    finally:
        engine.shutdown()
    if args.row_digests:
        found = digests.read(Path(args.row_digests))
        seeds = req.seeds or [req.seed + i for i in range(len(samples))]
        for s, seed in zip(samples, seeds, strict=True):
            s["row_digests"] = digests.sample_digests(found, seed, len(s["output_ids"]))
    result = {"request": asdict(req), "samples": samples, "sglang": sglang_origin(),
              "decode_graphs": graph_backends(engine.server_args)["decode"]}  # fmt: skip
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
