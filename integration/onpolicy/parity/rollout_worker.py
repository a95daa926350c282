"""The rollout side of `onpolicy parity`: one SGLang engine samples prompts, with log-probs.

`python -m onpolicy.parity.rollout_worker --ckpt DIR --request FILE --out FILE [--tp N]
[--ep N] [--dtype D] [--stock]` runs in its own process: SGLANG_USE_CPU_ENGINE must be set
before sglang is imported (`onpolicy.rollout.engine.engine_env`), and `Engine.shutdown()` kills
every descendant of the process that made the engine, so the engine never lives in the
driver. It reads a `RolloutRequest` (JSON), starts the engine (`launch`), samples (`sample`)
and writes {"request", "samples", "sglang"} (JSON).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from onpolicy.rollout.engine import RolloutRequest, launch, sample, sglang_origin


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.parity.rollout_worker",
                                 description=__doc__)  # fmt: skip
    ap.add_argument("--ckpt", required=True, help="HF checkpoint folder")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stock", action="store_true", help="SGLang's stock CPU path, not the exact")
    ap.add_argument("--request", required=True, help="JSON file of a RolloutRequest")
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    args = ap.parse_args(argv)
    req = RolloutRequest(**json.loads(Path(args.request).read_text()))
    engine = launch(args.ckpt, args.tp, args.ep, args.dtype, exact=not args.stock)
    try:
        samples = sample(engine, req)
    finally:
        engine.shutdown()
    result = {"request": asdict(req), "samples": samples, "sglang": sglang_origin()}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
