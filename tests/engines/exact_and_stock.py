"""What the routing and `--bisect` checks share: one exact and one stock engine, then one
trainer job.

Both engines (TP2 EP2, `return_routed_experts=True`, `sleep_on_idle` as the run's) start once:
each samples the routing prompts (`generate`) and captures the bisect sample
(`capture_generate`). They are stopped
before the trainer job (world 8: Megatron TP2 PP2 EP2 with SP), which then has the two cores to
itself: it scores every routing sequence with its routed experts and captures the bisect
points on each bisect sequence (workers/score_and_capture.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORKER = Path(__file__).parent / "workers" / "score_and_capture.py"
TEMPERATURE = 0.8
"""The exact engine's sampling temperature, and the trainer's."""
ROUTING_PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [10, 20, 30], [500, 600, 700, 800, 900, 17], [42, 43]]
ROUTING_NEW = 10
BISECT_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BISECT_NEW = 6


def run(tiny_checkpoint: Path, torchrun, work: Path, compile_cache: Path) -> dict:
    """{"routing": {"exact"|"stock": (samples, trainer log-probs, trainer routes)},
    "bisect": {"exact"|"stock": (rollout capture dir, trainer capture dir)}}."""
    from onpolicy.rollout.host import EngineHost

    # sleep_on_idle, as the run's engines have it: the idle one does not spin beside the other
    extra = {"return_routed_experts": True, "sleep_on_idle": True}
    hosts = {name: EngineHost.start(name, tiny_checkpoint, work, tp=2, ep=2,
                                    exact=name == "exact", engine_args=extra,
                                    cache=compile_cache)
             for name in ("exact", "stock")}  # fmt: skip
    samples, jobs, dirs = {}, [], {}
    try:
        for name, host in hosts.items():
            # The stock sampler ignores the seed: greedy keeps its control deterministic.
            temperature = TEMPERATURE if name == "exact" else 0.0
            client = host.connect()
            samples[name] = client.call("generate", request={
                "prompts": ROUTING_PROMPTS, "new_tokens": ROUTING_NEW,
                "temperature": temperature, "seed": 5, "return_routed_experts": True})  # fmt: skip
            rollout = work / f"{name}-rollout"
            request = {"prompts": [BISECT_PROMPT], "new_tokens": BISECT_NEW,
                       "temperature": TEMPERATURE, "seed": 7}  # fmt: skip
            sample = client.call("capture_generate", request=request, out_dir=str(rollout))
            client.close()
            dirs[name] = (rollout, work / f"{name}-trainer")
            jobs.append({"tokens": sample["prompt"] + sample["output_ids"],
                         "out_dir": str(dirs[name][1])})  # fmt: skip
    finally:
        for h in hosts.values():
            h.stop()
    seqs = [s["prompt"] + s["output_ids"] for name in ("exact", "stock") for s in samples[name]]
    (work / "sequences.json").write_text(json.dumps(seqs))
    (work / "jobs.json").write_text(json.dumps(jobs))
    torchrun(WORKER, 8, "--ckpt", str(tiny_checkpoint), "--sequences", str(work / "sequences.json"),
             "--jobs", str(work / "jobs.json"), "--temperature", str(TEMPERATURE),
             "--out", str(work / "trainer.pt"), "--tp", "2", "--pp", "2", "--ep", "2", "--sp",
             "--mb-tokens", "32", timeout=900)  # fmt: skip
    got = torch.load(work / "trainer.pt")
    n = len(ROUTING_PROMPTS)
    routing = {"exact": (samples["exact"], got["logprobs"][:n], got["routes"][:n]),
               "stock": (samples["stock"], got["logprobs"][n:], got["routes"][n:])}  # fmt: skip
    return {"routing": routing, "bisect": dirs}
