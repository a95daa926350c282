"""Per-token log-probs of given sequences from the Megatron model, as the rollout computes them.

- `PackedBatch`: sequences of any lengths packed end to end (THD), with `cu_seqlens`, the
  next-token targets and the `PackedSeqParams` the exact model takes.
- `token_logprobs(logits, targets, temperature)`: differentiable fp32 log p(target) from this
  rank's vocab-parallel logits, `log_softmax(logits / T)` as `kernels.token_logprobs` computes it
  on the full vocab: the max over ranks (exact in any order), each rank's `kernels.sumexp_partial`
  over its whole vocab segments, the tree over ranks (`collectives.tree_all_reduce`), and the
  target's logit from the rank that owns it. Not Megatron's cross-entropy, whose sum order and
  formula differ.
- `logprobs(model, sequences, temperature)`: forward-only through megatron-core's schedules at
  any layout; every rank passes the same sequences, each DP replica scores its share, and
  global rank 0 (the driver) receives every sequence's values once. With `routes=True` it also
  returns every token's routed expert ids (`RouteRecorder`), to compare with the rollout's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from onpolicy import bits, collectives
from onpolicy import kernels as K
from onpolicy.contract.errors import ContractError
from onpolicy.kernels.rules import vocab_parallel_exact, vocab_segments


@dataclass(kw_only=True, slots=True)
class PackedBatch:
    """Sequences packed end to end, then (if needed) one padding segment."""

    tokens: torch.Tensor
    """[T] int64 token ids: the sequences in order, then the padding segment."""
    cu_seqlens: torch.Tensor
    """[segments + 1] int32 segment starts; the padding segment, if any, is the last one."""
    num_sequences: int
    """Segments that are real sequences (the rest is padding)."""

    @classmethod
    def pack(cls, sequences: Sequence[Sequence[int] | torch.Tensor], *, multiple_of: int = 1,
             pad_id: int = 0) -> PackedBatch:  # fmt: skip
        """Pack `sequences`; pad with one extra segment to a multiple of `multiple_of` tokens
        (sequence parallel splits the packed length over TP)."""
        seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("PackedBatch.pack: an empty sequence has no tokens to score")
        lengths = [len(s) for s in seqs]
        pad = -sum(lengths) % multiple_of
        if pad == 0 and not seqs:
            pad = multiple_of  # an empty micro-batch still runs through every rank's layers
        if pad:
            seqs.append(torch.full((pad,), pad_id, dtype=torch.long))
            lengths.append(pad)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        return cls(tokens=torch.cat(seqs), cu_seqlens=cu, num_sequences=len(sequences))

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every real sequence in the packed tokens."""
        cu = self.cu_seqlens.tolist()
        return list(itertools.pairwise(cu))[: self.num_sequences]

    @property
    def positions(self) -> torch.Tensor:
        """[T] position of each token inside its own segment."""
        cu = self.cu_seqlens.tolist()
        return torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])

    @property
    def targets(self) -> torch.Tensor:
        """[T] the next token of each position's sequence; 0 at a segment's last position."""
        nxt = torch.zeros_like(self.tokens)
        for a, b in itertools.pairwise(self.cu_seqlens.tolist()):
            nxt[a : b - 1] = self.tokens[a + 1 : b]
        return nxt

    def packed_seq_params(self, device: torch.device | str = "cpu"):
        """megatron-core's THD parameters for this batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device)
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip

    def split(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Per real sequence, the values of positions 0..len-2 (those that predict a token)."""
        return [per_token[a : b - 1] for a, b in self.spans]


class _FromOwner(torch.autograd.Function):
    """Each token's value from the TP rank owning its target's vocab shard; the gradient goes to
    that rank only (the loss downstream is the same on every TP rank)."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, owner: torch.Tensor, group) -> torch.Tensor:
        ctx.save_for_backward(owner)
        ctx.rank = dist.get_rank(group)
        every = collectives.all_gather(mine[None], group, dim=0)
        return every.gather(0, owner[None])[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (owner,) = ctx.saved_tensors
        return torch.where(owner == ctx.rank, grad, torch.zeros_like(grad)), None, None


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   group=None) -> torch.Tensor:  # fmt: skip
    """fp32 log p(targets) [...] under log_softmax(logits / T) over the full vocab.

    `logits` [..., V/tp] is this rank's vocab shard (the model output), `group` the TP group
    (default megatron-core's). Bit for bit `kernels.token_logprobs` of the gathered logits when
    `rules.vocab_parallel_exact(V, tp)`; refused otherwise. Differentiable (exact forward, the
    native gradient), so a loss function can use it.
    """
    group = _tp_group() if group is None else group
    tp = dist.get_world_size(group)
    width = logits.shape[-1]
    vocab = width * tp
    if not vocab_parallel_exact(vocab, tp):
        raise ContractError(
            "vocab_parallel_exact",
            f"TP = {tp} cuts the vocab of {vocab} into shards of {width}, but the log-softmax sum "
            f"is a tree over {vocab_segments(vocab)} segments: a shard would not hold whole ones",
            "use a TP that divides the vocab's segment count",
        )
    x = K.scale_logits(logits, temperature).float()
    targets = targets.to(x.device).long()
    vmax = x.amax(dim=-1).detach()
    if tp > 1:
        vmax = collectives.all_gather(vmax[None], group, dim=0).amax(dim=0)
    total = collectives.tree_all_reduce(K.sumexp_partial(x, vmax, vocab_segments(vocab) // tp),
                                        group)  # fmt: skip
    lse = vmax + torch.log(total)
    mine = x.gather(-1, (targets % width)[..., None])[..., 0]
    picked = mine if tp == 1 else _FromOwner.apply(mine, targets // width, group)
    return picked - lse


def plan_micro_batches(lengths: Sequence[int], dp: int, budget: int) -> list[list[list[int]]]:
    """How `logprobs` deals sequences (by their `lengths`) to `dp` replicas: per replica, its
    micro-batches as sequence indices. A replica takes a contiguous share (the first
    len % dp one longer), cut in order into micro-batches of at most `budget` tokens (a longer
    sequence alone); every replica gets as many micro-batches, padded with empty ones, since
    EP exchanges tokens across replicas."""
    sizes = collectives.sequence_split_sizes(len(lengths), dp)
    starts = [0, *itertools.accumulate(sizes)]
    plans: list[list[list[int]]] = []
    for a, b in itertools.pairwise(starts):
        plan: list[list[int]] = []
        used = budget
        for i in range(a, b):
            if used + lengths[i] > budget or not plan:
                plan.append([])
                used = 0
            plan[-1].append(i)
            used += lengths[i]
        plans.append(plan)
    n_micro = max(1, *(len(p) for p in plans))
    return [p + [[] for _ in range(n_micro - len(p))] for p in plans]


class RouteRecorder:
    """The expert ids every `ExactRouter` of this rank's model chunks chooses, per forward.

    Forward hooks, removed by `close()`; nothing is recorded (or costs anything) without one.
    `ids[layer]` lists one int32 [rows, top_k] tensor per router call, in call order: a chunk
    runs its micro-batches in order, so call j is micro-batch j. The rows are the router's
    input tokens: this TP rank's slice of the packed micro-batch under sequence parallel, all
    of it otherwise.
    """

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from onpolicy.train.exact_moe import ExactRouter

        self.sequence_parallel = bool(models[0].config.sequence_parallel)
        self.ids: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for m in models:
            for mod in m.modules():
                if isinstance(mod, TopKRouter) and not isinstance(mod, ExactRouter):
                    raise TypeError(
                        f"logprobs(routes=True): {type(mod).__name__} is not onpolicy's "
                        "ExactRouter; routed expert ids are read from the exact spec's router"
                    )
                if isinstance(mod, ExactRouter):
                    self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, router, _inputs, output) -> None:
        ids = output[0]
        self.ids.setdefault(router.layer_number - 1, []).append(ids.to(torch.int32).cpu())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _route_pieces(
    rec: RouteRecorder, mine: list[list[int]], batches: list[PackedBatch]
) -> dict[tuple[int, int, int], torch.Tensor]:
    """This rank's share of every sequence's routes: (sequence, layer, first row) -> int32
    [rows, top_k]. Under SP each TP rank holds a contiguous slice of a micro-batch's packed
    rows; without it every TP rank holds them all, and TP rank 0 speaks for the group."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    sp = rec.sequence_parallel
    if not sp and tp_rank != 0:
        return {}
    pieces: dict[tuple[int, int, int], torch.Tensor] = {}
    for layer, calls in rec.ids.items():
        if len(calls) != len(batches):
            raise RuntimeError(
                f"logprobs(routes=True): layer {layer}'s router ran {len(calls)} times for "
                f"{len(batches)} micro-batches"
            )
        for idx, mb, ids in zip(mine, batches, calls, strict=True):
            total = len(mb.tokens)
            r0 = tp_rank * (total // tp) if sp else 0
            if ids.shape[0] != (total // tp if sp else total):
                raise RuntimeError(
                    f"logprobs(routes=True): layer {layer}'s router saw {ids.shape[0]} rows of a "
                    f"{total}-token micro-batch at TP {tp} (sequence parallel {sp})"
                )
            r1 = r0 + ids.shape[0]
            for i, (a, b) in zip(idx, mb.spans, strict=True):
                lo, hi = max(a, r0), min(b, r1)
                if lo < hi:
                    pieces[i, layer, lo - a] = ids[lo - r0 : hi - r0]
    return pieces


def _assemble_routes(parts: list[dict], lengths: Sequence[int], layers: int,
                     top_k: int) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's pieces into int32 [len_i, layers, top_k] per sequence; every row once."""
    out = [torch.full((n, layers, top_k), -1, dtype=torch.int32) for n in lengths]
    filled = [torch.zeros(n, layers, dtype=torch.int8) for n in lengths]
    for part in parts:
        for (i, layer, row), ids in part.items():
            out[i][row : row + len(ids), layer] = ids
            filled[i][row : row + len(ids), layer] += 1
    for i, f in enumerate(filled):
        if not bool((f == 1).all()):
            row, layer = (int(v) for v in torch.nonzero(f != 1)[0])
            raise RuntimeError(
                f"logprobs(routes=True): sequence {i} row {row} layer {layer} was routed "
                f"{int(f[row, layer])} times over the ranks; want once"
            )
    return out


def row_digests(logits: torch.Tensor, temperature: float, rows: int = 1024) -> torch.Tensor:
    """`bits.row_digests` of each position's whole fp32 log-prob row,
    `kernels.log_softmax(kernels.scale_logits(logits, T))` over the full vocab (this rank's
    shard [T, V/tp] is gathered over TP first, a copy): the exact sampler digests the same
    function of its logits (`rollout.digests`). `rows` positions at a time bound the memory."""
    full = logits if _tp_size() == 1 else collectives.all_gather(logits, _tp_group(), dim=-1)
    return torch.cat([
        bits.row_digests(K.log_softmax(K.scale_logits(full[i : i + rows], temperature)))
        for i in range(0, full.shape[0], rows)
    ]).cpu()  # fmt: skip


def _tp_size() -> int:
    return dist.get_world_size(_tp_group())


@torch.no_grad()
def logprobs(model, sequences: Sequence[Sequence[int] | torch.Tensor], temperature: float = 1.0,
             *, micro_batch_tokens: int = 4096, routes: bool = False,
             digests: bool = False):  # fmt: skip
    """Per sequence, fp32 log p(token i | tokens < i) for i = 1..len-1, through `forward_only`.

    Call on every rank with the same sequences. Each DP replica packs its share into THD
    micro-batches of at most `micro_batch_tokens` tokens (`plan_micro_batches`). Returns the
    list on global rank 0, in the order given; None on every other rank.

    `routes=True` returns `(logprobs, routes)` on global rank 0 (None elsewhere): routes[i] is
    int32 [len_i, layers, top_k], the global expert ids `ExactRouter` chose for every token of
    sequence i (position 0..len-1) in every layer, gathered from the SP shards, PP stages and
    DP replicas that routed them.

    `digests=True` returns `(logprobs, digests)` the same way: digests[i] is int64 [len_i - 1],
    `row_digests` of the whole log-prob row that scores token i + 1 (not with `routes`).
    """
    if routes and digests:
        raise ValueError("logprobs: routes and digests are not taken together")
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    models = list(model) if isinstance(model, list | tuple) else [model]
    tp = ps.get_tensor_model_parallel_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = plan_micro_batches([len(s) for s in sequences], dp, micro_batch_tokens)[dp_rank]
    n_micro = len(mine)
    batches = [PackedBatch.pack([sequences[i] for i in mb], multiple_of=tp) for mb in mine]
    device = next(models[0].parameters()).device

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        out = chunk(mb.tokens[None].to(device), mb.positions[None].to(device), None,
                    packed_seq_params=mb.packed_seq_params(device))  # fmt: skip

        def collect(output: torch.Tensor, non_loss_data: bool = True):
            values = token_logprobs(output[0], mb.targets, temperature).cpu()
            return (values, row_digests(output[0], temperature)) if digests else values

        return out, collect

    was_training = [m.training for m in models]
    rec = RouteRecorder(models) if routes else None
    for m in models:
        m.eval()
    try:
        per_mb = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=models,
            num_microbatches=n_micro, seq_length=max(len(b.tokens) for b in batches),
            micro_batch_size=1, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
    finally:
        if rec is not None:
            rec.close()
        for m, t in zip(models, was_training, strict=True):
            m.train(t)
    found: dict[int, torch.Tensor] = {}
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        for idx, mb, values in zip(mine, batches, per_mb, strict=True):
            if digests:
                values = list(zip(mb.split(values[0]), mb.split(values[1]), strict=True))
            else:
                values = mb.split(values)
            found.update(zip(idx, values, strict=True))
    lengths = [len(s) for s in sequences]
    sent = (found, _route_pieces(rec, mine, batches)) if rec is not None else found
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, gathered, dst=0)
    if gathered is None:
        return None
    if rec is not None:
        gathered, route_parts = [g[0] for g in gathered], [g[1] for g in gathered]
    merged = {i: v for part in gathered for i, v in part.items()}
    if sorted(merged) != list(range(len(sequences))):
        raise RuntimeError(
            f"logprobs: the last pipeline stage returned {len(merged)} of {len(sequences)} "
            "sequences"
        )
    values = [merged[i] for i in range(len(sequences))]
    if digests:
        return [v for v, _ in values], [d for _, d in values]
    if rec is None:
        return values
    cfg = models[0].config
    return values, _assemble_routes(route_parts, lengths, cfg.num_layers, cfg.moe_router_topk)
