"""SGLang Engines through three weight updates each, with a rollout after each, written as JSON.

The engines of one TP and EP (`--layouts`: their names, dtypes and paths) start one after the
other in this process, which imports SGLang once for them. Phases, all on one engine (its
launch dominates the cost):
1. `initial`: a rollout on the checkpoint it was started with;
2. `outside_session`: `update_weights_from_tensor` with other weights but no begin/end session,
   which 0.5.23 must reject, then a rollout;
3. `tensor`: begin, two `update_weights_from_tensor` buckets of full HF-named tensors (version
   set on the request), end, then a rollout;
4. `distributed`: a trainer process joins a gloo group with the engine's TP ranks and broadcasts
   a third checkpoint; begin, `update_weights_from_distributed` (version set), end, a rollout.
`python sglang_weights.py trainer ...` is that trainer process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

GROUP = "onpolicy_weights"


def trainer(args: argparse.Namespace) -> None:
    """Rank 0 of the weight-update group: broadcast every tensor, in the order of the names."""
    from datetime import timedelta

    import torch
    from onpolicy.models.hf_layout import read_hf_checkpoint
    from onpolicy.rendezvous import tcp_store
    from sglang.srt.utils.common import init_custom_process_group

    sd = read_hf_checkpoint(args.ckpt, strict=False).tensors
    # Rank 0 hosts the rendezvous store on a port the OS picks, and says which.
    # (bound on 127.0.0.1 only: torch's own TCPStore server listens on every interface)
    store = tcp_store("127.0.0.1", 0, args.world, is_master=True,
                      timeout=timedelta(seconds=900))  # fmt: skip
    print(f"PORT {store.port}", flush=True)
    # The engine's ranks wrap their store in PrefixStore(group name), as this does.
    pg = init_custom_process_group(
        backend="gloo", store=torch.distributed.PrefixStore(GROUP, store),
        world_size=args.world, rank=0, group_name=GROUP,
    )  # fmt: skip
    for name in json.loads(args.names):
        torch.distributed.broadcast(sd[name].contiguous(), src=0, group=pg)
    # This process hosts the group's store: it stays up until the engine has left the group
    # (a line on stdin), then leaves itself, so no rank outlives its peers' rendezvous.
    sys.stdin.readline()
    torch.distributed.destroy_process_group(pg)


def trainer_log(args: argparse.Namespace) -> Path:
    return Path(args.out).with_name(f"trainer-{args.name}.log")


def engine_phases(args: argparse.Namespace) -> list[dict]:
    from onpolicy.models.hf_layout import read_hf_checkpoint
    from onpolicy.rollout.engine import RolloutRequest

    req = RolloutRequest(prompts=json.loads(args.prompts), new_tokens=args.new_tokens,
                         temperature=args.temperature)  # fmt: skip
    dist_sd = read_hf_checkpoint(args.distributed_ckpt, strict=False).tensors
    # Started first, so its imports overlap the engine's start; it then waits at the group's
    # rendezvous until the engine joins in the `distributed` phase.
    trainer_proc = subprocess.Popen([
        sys.executable, __file__, "trainer", "--ckpt", args.distributed_ckpt,
        "--world", str(1 + args.tp), "--names", json.dumps(list(dist_sd)),
    ], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(trainer_log(args), "w"),
       text=True)  # fmt: skip
    try:
        return run_phases(args, req, dist_sd, trainer_proc)
    finally:
        if trainer_proc.poll() is None:  # the engine failed before the trainer could finish
            trainer_proc.kill()


def run_phases(args, req, dist_sd: dict, trainer_proc: subprocess.Popen) -> list:
    from onpolicy.models.hf_layout import read_hf_checkpoint
    from onpolicy.rollout.engine import launch, sample
    from sglang.srt.managers.io_struct import (
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    # sleep_on_idle, as the run's engines: while it waits for the trainer process (importing
    # beside it) an idle scheduler waits on its sockets instead of spinning
    engine = launch(args.ckpt, args.tp, args.ep, args.dtype, exact=not args.stock,
                    sleep_on_idle=True)  # fmt: skip
    tm, run = engine.tokenizer_manager, engine.loop.run_until_complete
    phases: list[dict] = []

    def record(name: str, **info: object) -> None:
        phases.append({"phase": name, **info, "samples": sample(engine, req)})

    try:
        record("initial")

        tensor_sd = read_hf_checkpoint(args.tensor_ckpt, strict=False).tensors
        ok, msg = engine.update_weights_from_tensor(list(tensor_sd.items()))
        record("outside_session", success=ok, message=msg)

        # Two buckets (experts, then the rest); only the last flushes the cache.
        buckets = [[(n, t) for n, t in tensor_sd.items() if ".experts." in n],
                   [(n, t) for n, t in tensor_sd.items() if ".experts." not in n]]  # fmt: skip
        results = [engine.begin_weight_update()]
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            # One payload per TP rank: a CPU tensor's shared-memory handle can be taken once.
            payloads = [MultiprocessingSerializer.serialize(bucket) for _ in range(args.tp)]
            obj = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payloads,
                flush_cache=last, weight_version=args.tensor_version if last else None,
            )  # fmt: skip
            results.append(run(tm.update_weights_from_tensor(obj, None)))
        results.append(engine.end_weight_update())
        record("tensor", results=results)

        line = trainer_proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the trainer process exited ({trainer_proc.wait()}) before "
                               f"opening its rendezvous port (said {line!r})")  # fmt: skip
        port, names, world = int(line.split()[1]), list(dist_sd), 1 + args.tp
        results = [engine.init_weights_update_group("127.0.0.1", port, 1, world, GROUP,
                                                     backend="gloo")]  # fmt: skip
        results.append(engine.begin_weight_update())
        obj = UpdateWeightsFromDistributedReqInput(
            names=names,
            dtypes=[str(dist_sd[n].dtype).removeprefix("torch.") for n in names],
            shapes=[list(dist_sd[n].shape) for n in names],
            group_name=GROUP, weight_version=args.distributed_version,
        )  # fmt: skip
        results.append(run(tm.update_weights_from_distributed(obj, None)))
        results.append(engine.end_weight_update())
        results.append(engine.destroy_weights_update_group(GROUP))
        trainer_proc.stdin.write("left\n")
        trainer_proc.stdin.flush()
        rc = trainer_proc.wait(timeout=300)
        tail = "" if rc == 0 else trainer_log(args).read_text()[-4000:]
        record("distributed", results=results, trainer_rc=rc, trainer_log=tail)
    finally:
        engine.shutdown()
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--ckpt", required=True, help="the checkpoint the engine starts with")
    e.add_argument("--tensor-ckpt", required=True, help="weights for update_weights_from_tensor")
    e.add_argument("--distributed-ckpt", required=True, help="weights the trainer broadcasts")
    e.add_argument("--tensor-version", default="v1")
    e.add_argument("--distributed-version", default="v2")
    e.add_argument("--out", required=True)
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--ep", type=int, default=1)
    e.add_argument(
        "--layouts",
        required=True,
        help='JSON [{"name", "dtype", "stock"}], engines started in this order',
    )
    e.add_argument("--new-tokens", type=int, default=8)
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--prompts", default="[[1, 2, 3, 4], [10, 20, 30], [500, 600, 700, 800, 900]]")
    t = sub.add_parser("trainer")
    t.add_argument("--ckpt", required=True)
    t.add_argument("--world", type=int, required=True)
    t.add_argument("--names", required=True)
    args = ap.parse_args()
    if args.cmd == "trainer":
        trainer(args)
        return
    runs = {}
    for layout in json.loads(args.layouts):
        runs[layout["name"]] = engine_phases(argparse.Namespace(**{**vars(args), **layout}))
    with open(args.out, "w") as f:
        json.dump({"runs": runs}, f, default=str)


if __name__ == "__main__":
    main()
