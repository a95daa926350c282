"""The trainer's compile warm-up (`TrainerActor.warm_up`: scoring, then the update's forward
and backward, on the warm-up batches, with no optimizer step) leaves nothing behind: the next
PPO step gives the loss, the gradient norm and the parameters, bit for bit, that it gives with
no warm-up. On CUDA the warm-up runs at every setup (a resumed run too), so a trace of it
would also be in every step. Control: one real step in place of the warm-up moves all three.
Each case is one trainer rank at world 1 on CPU/gloo in its own process
(workers/trainer_warmup.py, the `trainer_runs` fixture)."""

from __future__ import annotations


def test_a_warm_up_leaves_the_next_step_bit_for_bit(trainer_runs):
    plain, warmed = trainer_runs["nothing"], trainer_runs["warmup"]
    assert warmed["warmup_batches"] > 1, warmed
    for what in ("loss", "grad_norm", "digest"):
        assert warmed[what] == plain[what], (what, warmed, plain)


def test_negative_control_a_real_step_before_moves_the_next_one(trainer_runs):
    plain, stepped = trainer_runs["nothing"], trainer_runs["step"]
    for what in ("loss", "grad_norm", "digest"):
        assert stepped[what] != plain[what], (what, stepped, plain)
