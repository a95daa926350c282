"""One PPO-clip optimizer step of the policy on megatron-core: DDP + the distributed optimizer,
Megatron's schedules (`get_forward_backward_func`), the loss on the differentiable exact
per-token log-probs of the model output (`logprobs.token_logprobs`).

The global batch is given per sequence, the same on every rank, in the form `logprobs.logprobs`
returns (values for tokens 1..len-1). `policy_micro_batches` deals it out as `logprobs.logprobs`
does (`logprobs.plan_micro_batches`): contiguous shares over DP, packed THD micro-batches of at
most `micro_batch_tokens` tokens, padded to a multiple of TP, as many on every replica.

Normalisation: every micro-batch's loss_func hands Megatron the masked *sum* of per-token
losses and its token count, with `calculate_per_token_loss` on. The schedule then neither
divides by the micro-batch count nor does DDP by the DP size; `finalize_model_grads` sums the
counts over micro-batches and DP ranks and divides the summed gradient once. The gradient is
that of `loss.ppo_clip_loss` on the whole global batch (a token mean over all its unmasked
tokens), however it is split into micro-batches and DP ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from onpolicy.train.logprobs import PackedBatch, plan_micro_batches, token_logprobs
from onpolicy.train.loss import PPOClipConfig, ppo_clip_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    """Adam and its wrapping: what `setup_training` builds."""

    lr: float = 1e-6
    """Learning rate (constant; no scheduler is attached)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all ranks); 0 turns clipping off."""
    distributed_optimizer: bool = True
    """Shard the fp32 main params and Adam state over DP (Megatron's DistributedOptimizer)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 even for bf16 params (bf16 sums over
    micro-batches and DP ranks would round at every add)."""

    def __post_init__(self) -> None:
        # Checked here, before any rank starts: torch's AdamW would refuse some of these only
        # inside a trainer actor, after the run had set up.
        rules = [
            (self.lr > 0.0 and math.isfinite(self.lr), "lr must be finite and above 0", self.lr),
            (
                self.weight_decay >= 0.0 and math.isfinite(self.weight_decay),
                "weight_decay must be finite and >= 0",
                self.weight_decay,
            ),
            (0.0 <= self.adam_beta1 < 1.0, "adam_beta1 must be in [0, 1)", self.adam_beta1),
            (0.0 <= self.adam_beta2 < 1.0, "adam_beta2 must be in [0, 1)", self.adam_beta2),
            (
                self.adam_eps > 0.0 and math.isfinite(self.adam_eps),
                "adam_eps must be finite and above 0",
                self.adam_eps,
            ),
            (
                self.clip_grad >= 0.0 and math.isfinite(self.clip_grad),
                "clip_grad must be finite and >= 0 (0: off)",
                self.clip_grad,
            ),
        ]
        for ok, rule, value in rules:
            if not ok:
                raise ValueError(f"OptimizerSettings: {rule}, got {value}")


@dataclass(kw_only=True, slots=True)
class PolicyMicroBatch:
    """One micro-batch of the policy update: model inputs and the per-token PPO inputs, each
    per-token tensor [T] aligned with the log-probs that `logprobs_of` returns."""

    inputs: Any
    """What `forward` feeds the model: a `PackedBatch` for the exact model."""
    old_logprobs: torch.Tensor
    """Log-probs of the sampling policy (the rollout's)."""
    advantages: torch.Tensor
    """Per-token advantages."""
    loss_mask: torch.Tensor
    """1 where the token is trained on (response tokens), 0 elsewhere (and on padding)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-policy log-probs for the KL term (needed when kl_coef > 0)."""


Forward = Callable[[torch.nn.Module, Any], torch.Tensor]
"""(model chunk, micro-batch inputs) -> the chunk's output (logits on the last stage)."""
LogprobsOf = Callable[[torch.Tensor, Any, float], torch.Tensor]
"""(last-stage output, micro-batch inputs, temperature) -> differentiable log-probs [T]."""


def packed_forward(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """The model on one packed THD micro-batch."""
    device = next(model.parameters()).device
    return model(batch.tokens[None].to(device), batch.positions[None].to(device), None,
                 packed_seq_params=batch.packed_seq_params(device))  # fmt: skip


def packed_logprobs(output: torch.Tensor, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """Exact log p(next token) [T] at every packed position from this rank's vocab shard."""
    return token_logprobs(output[0], batch.targets, temperature)


def _spread(batch: PackedBatch, values: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """Per-sequence values (one per predicted token, len - 1) at their packed positions; 0 at
    each segment's last position and on the padding."""
    out = torch.zeros(len(batch.tokens), dtype=torch.float32)
    for (a, b), v in zip(batch.spans, values, strict=True):
        v = torch.as_tensor(v, dtype=torch.float32).reshape(-1)
        if len(v) != b - a - 1:
            raise ValueError(
                f"pack_micro_batch: {what} of a {b - a}-token sequence must hold {b - a - 1} "
                f"values (one per predicted token), got {len(v)}"
            )
        out[a : b - 1] = v
    return out


def pack_micro_batch(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    old_logprobs: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    *,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    multiple_of: int = 1,
) -> PolicyMicroBatch:
    """One packed THD micro-batch of `sequences` (padded to a multiple of `multiple_of` tokens)
    with each per-token input (len(sequence) - 1 values per sequence, as `logprobs.logprobs`
    returns) at the packed position that predicts its token."""
    n = len(sequences)
    per_seq = {"old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_masks,
               "ref_logprobs": ref_logprobs}  # fmt: skip
    for what, values in per_seq.items():
        if values is not None and len(values) != n:
            raise ValueError(f"pack_micro_batch: {n} sequences but {len(values)} {what}")
    batch = PackedBatch.pack(sequences, multiple_of=multiple_of)
    spread = {k: None if v is None else _spread(batch, v, k) for k, v in per_seq.items()}
    return PolicyMicroBatch(inputs=batch, **spread)


def policy_micro_batches(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    old_logprobs: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    *,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    micro_batch_tokens: int = 4096,
) -> list[PolicyMicroBatch]:
    """This rank's micro-batches of the global batch (every rank passes the same lists; each
    per-token list entry holds len(sequence) - 1 values)."""
    from megatron.core import parallel_state as ps

    per_seq = (old_logprobs, advantages, loss_masks, ref_logprobs)
    names = ("old_logprobs", "advantages", "loss_masks", "ref_logprobs")
    for what, values in zip(names, per_seq, strict=True):
        if values is not None and len(values) != len(sequences):
            raise ValueError(
                f"policy_micro_batches: {len(sequences)} sequences but {len(values)} {what}"
            )
    tp = ps.get_tensor_model_parallel_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    plan = plan_micro_batches([len(s) for s in sequences], dp, micro_batch_tokens)

    def pick(values, idx):
        return None if values is None else [values[i] for i in idx]

    return [
        pack_micro_batch(
            [sequences[i] for i in idx],
            *(pick(v, idx) for v in per_seq[:3]),
            ref_logprobs=pick(ref_logprobs, idx),
            multiple_of=tp,
        )
        for idx in plan[dp_rank]
    ]


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one step reports, the same on every rank."""

    loss: float
    """Token-mean PPO loss of the global batch, at the weights before the step."""
    grad_norm: float
    """Global gradient norm before clipping (Megatron computes it only when clip_grad > 0)."""
    num_tokens: int
    """Unmasked tokens of the global batch."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Token means over the global batch: pg_loss, kl, clip_frac(_low/_high), approx_kl, ratio."""


def setup_training(
    model: torch.nn.Module | Sequence[torch.nn.Module], settings: OptimizerSettings
) -> tuple[list[torch.nn.Module], Any]:
    """Wrap the model chunks in Megatron DDP and build Megatron's (distributed) Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    config = chunks[0].config
    # Read by DDP's constructor (no 1/dp pre-scaling) and by the schedules: set before wrapping.
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        use_distributed_optimizer=settings.distributed_optimizer,
    )
    ddp = [
        DistributedDataParallel(config, ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad,
            bf16=config.params_dtype == torch.bfloat16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.distributed_optimizer,
        ),
        ddp,
    )
    return ddp, optimizer


def _forward_step(data_iterator, model, *, forward: Forward, logprobs_of: LogprobsOf,
                  loss: PPOClipConfig, temperature: float):  # fmt: skip
    mb: PolicyMicroBatch = next(data_iterator)
    output = forward(model, mb.inputs)

    def loss_func(output_tensor: torch.Tensor):
        lp = logprobs_of(output_tensor, mb.inputs, temperature)
        per_token = (mb.old_logprobs, mb.advantages, mb.loss_mask, mb.ref_logprobs)
        old, adv, mask, ref = (None if t is None else t.to(lp.device) for t in per_token)
        out = ppo_clip_loss(lp, old, adv, mask, loss, ref)
        reduced = {"loss": out.loss_sum.detach(), "num_tokens": out.num_tokens.float(),
                   **out.metrics}  # fmt: skip
        return out.loss_sum, out.num_tokens.to(torch.int), reduced

    return output, loss_func


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[PolicyMicroBatch],
    *,
    loss: PPOClipConfig,
    temperature: float = 1.0,
    forward: Forward = packed_forward,
    logprobs_of: LogprobsOf = packed_logprobs,
) -> dict[str, torch.Tensor]:
    """Zero the grads, run the schedule with backward, finalize (DP reduce, /tokens).

    Returns the global batch's token sums (loss, num_tokens, metrics) on every rank: the last
    stage's micro-batch sums, summed over DP, sent to every stage.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("forward_backward: no micro-batches")
    for chunk in chunks:
        chunk.zero_grad_buffer()
    seq = max(int(mb.loss_mask.numel()) for mb in microbatches)
    step = partial(_forward_step, forward=forward, logprobs_of=logprobs_of, loss=loss,
                   temperature=temperature)  # fmt: skip
    out = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(microbatches), model=list(chunks),
        num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=1,
        forward_only=False,
    )  # fmt: skip
    keys = ["loss", "num_tokens", "pg_loss", "kl", "clip_frac_low", "clip_frac_high", "clip_frac",
            "approx_kl", "ratio"]  # fmt: skip
    device = next(chunks[0].parameters()).device
    sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage():
        for reduced in out:
            sums += torch.stack([reduced[k].double() for k in keys])
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(sums, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())  # fmt: skip
    return dict(zip(keys, sums.cpu(), strict=True))


def train_step(
    chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    microbatches: Sequence[PolicyMicroBatch],
    *,
    loss: PPOClipConfig,
    temperature: float = 1.0,
    forward: Forward = packed_forward,
    logprobs_of: LogprobsOf = packed_logprobs,
) -> StepResult:
    """One optimizer step on this rank's micro-batches of the global batch."""
    for chunk in chunks:
        chunk.train()
    optimizer.zero_grad()
    sums = forward_backward(chunks, microbatches, forward=forward, logprobs_of=logprobs_of,
                            loss=loss, temperature=temperature)  # fmt: skip
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("train_step: the optimizer skipped the step (non-finite gradients)")
    n = float(sums["num_tokens"])
    means = {k: float(v) / max(n, 1.0) for k, v in sums.items() if k != "num_tokens"}
    norm = float("nan") if grad_norm is None else float(grad_norm)
    return StepResult(loss=means.pop("loss"), grad_norm=norm, num_tokens=int(n), metrics=means)
