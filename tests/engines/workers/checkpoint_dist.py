"""One torchrun job of the torch-dist checkpoint tests (onpolicy.checkpoint.torch_dist), gloo/CPU.

--mode:
- save-layout: the model checkpoint (--model, written by `onpolicy convert hf-to-dist` at this
  layout) scored by the exact spec (`logprobs`) and by the stock local spec (the control);
  then training with the distributed optimizer: one step, saved with the optimizer as
  WORK/train iteration 1; a second step, saved model-only as WORK/cont iteration 2; and a
  fresh model + optimizer loaded from WORK/train taking the same second step (the resume).
- other-layout: the same two scores at another layout; WORK/train loaded with its optimizer,
  re-saved as WORK/resave, then the second step, saved model-only as WORK/resh.
- world1: the two scores at world 1; WORK/train with its optimizer (refused: EP2 -> EP1) and
  model-only; then the killed writer's root WORK/kill: its `latest` loaded, iteration 2 saved,
  iteration 2 saved again (refused).
- kill: WORK/kill iteration 1, then iteration 2 of changed weights whose publish step (the
  manifest, the rename, `latest`) never comes: the test SIGKILLs the job while it waits.
Rank 0 writes WORK/{mode}.pt; every rank of save-layout and other-layout also writes
WORK/{mode}-rank{r}.pt with its parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in torch_dist.single_chunk(model).named_parameters()}


def step_record(s) -> dict:
    return {"loss": s.loss, "grad_norm": s.grad_norm, "num_tokens": s.num_tokens}


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work)
        self.cfg = Qwen3MoeConfig.from_hf(args.hf)
        self.layout = ParallelLayout.from_args(args)
        init_parallel(self.layout)
        self.seqs = json.loads(Path(args.sequences).read_text())
        self.rank = dist.get_rank()

    def model(self, spec: str = "exact", weights: dict | None = None):
        set_seed()
        return build_model(self.cfg, self.layout, DTYPE, spec=spec, weights=weights)

    def load(self, path, model, optimizer=None) -> dict:
        return torch_dist.load(path, model, optimizer=optimizer, cfg=self.cfg, layout=self.layout)

    def save(self, root, model, iteration: int, optimizer=None) -> None:
        torch_dist.save(root, model, optimizer=optimizer, iteration=iteration, cfg=self.cfg,
                        layout=self.layout, dtype=DTYPE, source_hf=self.args.hf)  # fmt: skip

    def scores(self) -> dict:
        """Exact-spec and stock-spec log-probs of the sequences from the model checkpoint."""
        exact = self.model("exact")
        t = time.perf_counter()
        self.load(self.args.model, exact)
        load_s = time.perf_counter() - t
        values = logprobs(exact, self.seqs, micro_batch_tokens=64)
        stock = self.model("local")
        self.load(self.args.model, stock)
        control = stock_logprobs(stock, self.seqs, 1.0)
        if self.rank != 0:
            return {}
        return {"exact": values, "stock": control["stock_logsoftmax"], "load_s": load_s}

    def micro_batches(self, batch: dict):
        return policy_micro_batches(batch["sequences"], batch["old_logprobs"],
                                    batch["advantages"], batch["loss_masks"],
                                    ref_logprobs=batch["ref_logprobs"],
                                    micro_batch_tokens=MICRO_BATCH_TOKENS)  # fmt: skip

    def trainer(self):
        model = self.model("exact")
        return setup_training(model, SETTINGS)

    def timed_save(self, rec: dict, key: str, *a, **kw) -> None:
        t = time.perf_counter()
        self.save(*a, **kw)
        rec[key] = time.perf_counter() - t

    def save_layout(self) -> tuple[dict, dict]:
        rec, mine = self.scores(), {}
        chunks, opt = self.trainer()
        self.load(self.args.model, chunks)
        raw = global_batch(self.cfg.vocab_size, 0)
        lp = scored(chunks, raw)
        noisy = lambda key: [x + n for x, n in zip(lp, raw[key], strict=True)]  # noqa: E731
        batch = {"sequences": raw["sequences"], "advantages": raw["advantages"],
                 "loss_masks": raw["loss_masks"], "old_logprobs": noisy("old_noise"),
                 "ref_logprobs": noisy("ref_noise")}  # fmt: skip
        if self.rank == 0:
            torch.save(batch, self.work / "batch.pt")
        mbs = self.micro_batches(batch)
        rec["step1"] = step_record(train_step(chunks, opt, mbs, loss=LOSS))
        mine["p1"] = params(chunks)
        self.timed_save(rec, "save_opt_s", self.work / "train", chunks, 1, optimizer=opt)
        rec["step2"] = step_record(train_step(chunks, opt, mbs, loss=LOSS))
        mine["p2"] = params(chunks)
        self.timed_save(rec, "save_model_s", self.work / "cont", chunks, 2)
        # The resume: fresh objects, state from disk only.
        chunks_r, opt_r = self.trainer()
        t = time.perf_counter()
        self.load(self.work / "train", chunks_r, opt_r)
        rec["load_opt_s"] = time.perf_counter() - t
        rec["step2_resumed"] = step_record(train_step(chunks_r, opt_r, mbs, loss=LOSS))
        mine["p2_resumed"] = params(chunks_r)
        return rec, mine

    def other_layout(self) -> tuple[dict, dict]:
        rec, mine = self.scores(), {}
        chunks, opt = self.trainer()
        t = time.perf_counter()
        self.load(self.work / "train", chunks, opt)
        rec["load_opt_s"] = time.perf_counter() - t
        self.timed_save(rec, "save_opt_s", self.work / "resave", chunks, 1, optimizer=opt)
        batch = torch.load(self.work / "batch.pt")
        rec["step2"] = step_record(train_step(chunks, opt, self.micro_batches(batch), loss=LOSS))
        mine["p2"] = params(chunks)
        self.save(self.work / "resh", chunks, 2)
        return rec, mine

    def world1(self) -> tuple[dict, dict]:
        rec = self.scores()
        chunks, opt = self.trainer()
        try:
            self.load(self.work / "train", chunks, opt)
            rec["optimizer_refusal"] = None
        except CheckpointError as e:
            rec["optimizer_refusal"] = {"rule": e.rule, "message": str(e)}
        model = self.model("exact")
        manifest = self.load(self.work / "train", model)
        rec["model_only"] = {"iteration": manifest["iteration"],
                             "hf": megatron_to_hf(self.cfg, model.state_dict())}  # fmt: skip
        # The killed writer's root.
        kill = self.work / "kill"
        rec["kill_latest_before"] = (kill / torch_dist.TRACKER).read_text().strip()
        rec["kill_stale_tmp"] = sorted(p.name for p in kill.iterdir())
        model = self.model("exact")
        rec["kill_loaded"] = self.load(kill, model)["iteration"]
        rec["kill_params"] = params(model)
        self.save(kill, model, 2)
        rec["kill_after"] = sorted(p.name for p in kill.iterdir())
        rec["kill_latest_after"] = (kill / torch_dist.TRACKER).read_text().strip()
        try:
            self.save(kill, model, 2)
            rec["exists_refusal"] = None
        except CheckpointError as e:
            rec["exists_refusal"] = {"rule": e.rule, "message": str(e)}
        return rec, {}

    def kill(self) -> tuple[dict, dict]:
        hf = read_hf_checkpoint(self.args.hf, strict=False).tensors
        model = self.model("exact", hf_to_megatron(self.cfg, hf, self.layout, self.rank, DTYPE))
        root = self.work / "kill"
        self.save(root, model, 1)
        torch.save({"params": params(model)}, self.work / "kill.pt")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2)

        def stall(tmp, final, manifest):  # the writer hangs after its shards are on disk
            (self.work / "stalled").write_text(f"{os.getpid()}\n")
            time.sleep(3600)

        torch_dist._publish = stall
        self.save(root, model, 2)
        return {}, {}


def main(args: argparse.Namespace) -> None:
    run = Run(args)
    if run.rank == 0:
        import megatron.core

        print(f"megatron.core from {os.path.dirname(megatron.core.__file__)}", flush=True)
    mode = args.mode.replace("-", "_")
    rec, mine = getattr(run, mode)()
    if mine:
        torch.save({**mine, "coords": run.layout.coords(run.rank)},
                   run.work / f"{args.mode}-rank{run.rank}.pt")  # fmt: skip
    if run.rank == 0:
        torch.save(rec, run.work / f"{args.mode}.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Imported only when run, not at the top: megatron-core's save starts a spawn Manager,
    # which re-imports this file as __mp_main__; a light module body keeps that start cheap.
    import torch
    import torch.distributed as dist
    from engines.workers.megatron_exact import stock_logprobs
    from engines.workers.megatron_train import LOSS, MICRO_BATCH_TOKENS, global_batch, scored
    from megatron.core import parallel_state as ps
    from onpolicy.checkpoint import torch_dist
    from onpolicy.layout import ParallelLayout
    from onpolicy.models.hf_layout import CheckpointError, read_hf_checkpoint
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
    from onpolicy.train.builder import build_model, init_parallel, set_seed
    from onpolicy.train.hf_megatron import hf_to_megatron, megatron_to_hf
    from onpolicy.train.logprobs import logprobs
    from onpolicy.train.step import (
        OptimizerSettings,
        policy_micro_batches,
        setup_training,
        train_step,
    )

    DTYPE = torch.bfloat16
    SETTINGS = OptimizerSettings(lr=1e-3, distributed_optimizer=True, clip_grad=1.0)

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True,
                    choices=["save-layout", "other-layout", "world1", "kill"])  # fmt: skip
    ap.add_argument("--hf", required=True, help="the source HF checkpoint")
    ap.add_argument("--model", default="", help="the model-only torch-dist root")
    ap.add_argument("--work", required=True, help="checkpoint roots and records")
    ap.add_argument("--sequences", required=True, help="JSON list of token-id lists")
    ParallelLayout.add_arguments(ap)
    main(ap.parse_args())
