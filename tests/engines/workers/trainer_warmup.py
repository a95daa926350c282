"""One GRPO trainer rank at world 1 on CPU/gloo, as the loop runs it (`TrainerActor`): set up
from the tiny checkpoint (fp32, a KL term, so a frozen reference model too), then, by --before,
nothing, the setup's compile warm-up (`warm_up`: scoring and the update's forward and backward
on the warm-up batches), or one real step on another seeded batch (the control); then one
PPO step on a seeded batch. Prints one JSON line: the step's loss and grad norm (float hex) and
the digest of every parameter after it. With --score-out DIR it then scores that batch with
routes and pickles what `score` returns (score.pkl) and the same values as torch tensors
(score_torch.pkl), as this process would hand them to the driver."""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import torch
from onpolicy.grpo.actors import TrainerActor, TrainerSpec
from onpolicy.layout import ParallelLayout
from onpolicy.train.loss import PPOClipConfig
from onpolicy.train.step import OptimizerSettings

MICRO_BATCH_TOKENS = 48


def batch(vocab: int, seed: int) -> dict:
    """Four sequences of 9 to 20 tokens, prompts of 3, seeded log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 20, 13, 11)]
    return {"sequences": seqs, "response_starts": [3] * len(seqs),
            "rollout_logprobs": [(-torch.rand(len(s) - 3, generator=g)).tolist() for s in seqs],
            "advantages": [1.0, -1.0, 0.5, -0.5]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--before", choices=["nothing", "warmup", "step"], required=True)
    ap.add_argument("--score-out")
    args = ap.parse_args()
    spec = TrainerSpec(layout=ParallelLayout(world=1), dtype="float32", device="cpu",
                       ckpt=args.ckpt, master_addr="127.0.0.1",
                       optimizer=OptimizerSettings(lr=1e-3), loss=PPOClipConfig(kl_coef=0.1),
                       sync=None, temperature=1.0,
                       micro_batch_tokens=MICRO_BATCH_TOKENS)  # fmt: skip
    actor = TrainerActor(0, spec)
    actor.open_rendezvous()
    actor.setup(0)
    warmed = None
    if args.before == "warmup":
        warmed = actor.warm_up()["batches"]
    elif args.before == "step":
        actor.train(batch(actor.cfg.vocab_size, seed=8))
    out = actor.train(batch(actor.cfg.vocab_size, seed=7))
    print(json.dumps({"warmup_batches": warmed, "loss": float(out["loss"]).hex(),
                      "grad_norm": float(out["grad_norm"]).hex(),
                      "digest": actor.params_digest()}))  # fmt: skip
    if args.score_out:  # after the digest: nothing it reports has seen this
        got = actor.score(batch(actor.cfg.vocab_size, seed=7)["sequences"], routes=True)
        as_torch = {**got, "logprobs": [torch.from_numpy(v) for v in got["logprobs"]],
                    "routes": [torch.from_numpy(r) for r in got["routes"]]}  # fmt: skip
        for name, value in (("score.pkl", got), ("score_torch.pkl", as_torch)):
            Path(args.score_out, name).write_bytes(pickle.dumps(value, protocol=5))
    actor.shutdown()


if __name__ == "__main__":
    main()
