"""Deterministic collectives: every cross-rank sum is the fixed pairwise tree, in rank order.

- `tree_all_reduce`: all-gather the partials, then `pairwise_tree_sum` over the rank dim. Every
  rank runs the same tree on the same bytes, so every rank holds the same result. For large
  messages `algo="scatter_gather"` gives the same bits at ring cost: `reduce_scatter`, then
  `all_gather` of the summed slices.
- `reduce_scatter`: an all-to-all hands rank r every rank's partial of slice r, then a local
  `pairwise_tree_sum` over the rank dim. Addition is elementwise, so each output element sees
  exactly the operands, order and pairing that `tree_all_reduce` gives it: the result is that
  all-reduce's slice r, bit for bit. Each rank sends (t-1)/t of its tensor, as a ring does.
- `all_gather`: data movement only, exact by nature.
- `ep_dispatch` / `ep_combine`: token rows go to the rank owning their expert and come back by
  all-to-all; the k expert outputs of a token are then summed by `kernels.moe_combine`, in
  ascending expert-id order, the same arithmetic as the single-rank MoE.

Autograd pairs match Megatron's mappings: all-reduce <-> identity (as
_ReduceFromModelParallelRegion), reduce-scatter <-> all-gather, and all-to-all <-> the reverse
all-to-all. Group sizes must be powers of 2: only then is a rank's share of the K-blocks an
aligned subtree, so that a sharded sum equals the unsharded one.

Works on any backend with all_gather_single and all_to_all_single: gloo (CPU), NCCL (GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from onpolicy.contract.errors import ContractError
from onpolicy.kernels import moe_combine
from onpolicy.kernels.rules import is_power_of_2
from onpolicy.kernels.tree import pairwise_tree_sum

Group = dist.ProcessGroup | None

# torch 2.13 renamed all_gather_into_tensor; the old name still works elsewhere.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Group = None, *, op: str = "collective") -> int:
    """The group's size, refused unless it is a power of 2."""
    t = dist.get_world_size(group)
    if not is_power_of_2(t):
        raise ContractError(
            "power_of_2_groups",
            f"{op} on a group of {t} ranks; the tree sum matches the unsharded one only for "
            "power-of-2 groups",
            "use a group of 1, 2, 4, 8, ... ranks (change TP, EP or ETP in the layout)",
        )
    return t


def sequence_split_sizes(n: int, t: int) -> list[int]:
    """torch.tensor_split's rule: the first n % t shards hold one extra row."""
    q, r = divmod(n, t)
    return [q + 1] * r + [q] * (t - r)


def _resolve_splits(n: int, t: int, split_sizes: Sequence[int] | None, op: str) -> list[int]:
    if split_sizes is None:
        return sequence_split_sizes(n, t)
    sizes = [int(s) for s in split_sizes]
    if len(sizes) != t or min(sizes) < 0 or sum(sizes) != n:
        raise ContractError(
            "split_sizes",
            f"{op}: split_sizes {sizes} do not cut a dim of {n} rows into {t} shards",
            f"pass {t} non-negative sizes summing to {n}, e.g. {sequence_split_sizes(n, t)}",
        )
    return sizes


def _all_to_all(x: torch.Tensor, group: Group, out_sizes: list[int], in_sizes: list[int]):
    """Rows of x, cut by in_sizes, go to ranks in order; out_sizes says what arrives from each."""
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_sizes, input_split_sizes=in_sizes, group=group
    )
    return out


ALGOS = ("gather", "scatter_gather")


def _tree_all_reduce(x: torch.Tensor, group: Group, algo: str = "gather") -> torch.Tensor:
    t = group_size(group, op="tree_all_reduce")
    if algo not in ALGOS:
        raise ContractError(
            "all_reduce_algo", f"tree_all_reduce algo {algo!r} is unknown", f"use one of {ALGOS}"
        )
    if t == 1:
        return x.clone()
    if algo == "scatter_gather":  # the same per-element tree; ring bytes instead of (t-1)x
        flat = x.contiguous().view(-1)
        sizes = sequence_split_sizes(flat.numel(), t)
        return _all_gather(_reduce_scatter(flat, group, 0, sizes), group, 0, sizes).view(x.shape)
    gathered = x.new_empty((t * x.numel(),))
    _all_gather_flat(gathered, x.contiguous().view(-1), group=group)
    return pairwise_tree_sum(gathered.view(t, *x.shape))


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int, split_sizes) -> torch.Tensor:
    t = group_size(group, op="reduce_scatter")
    rows = x.movedim(dim, 0)
    sizes = _resolve_splits(rows.shape[0], t, split_sizes, "reduce_scatter")
    if t == 1:
        return x.clone()
    mine = sizes[dist.get_rank(group)]
    received = _all_to_all(rows, group, [mine] * t, sizes)
    return pairwise_tree_sum(received.view(t, mine, *rows.shape[1:])).movedim(0, dim).contiguous()


def _all_gather(x: torch.Tensor, group: Group, dim: int, split_sizes) -> torch.Tensor:
    t = group_size(group, op="all_gather")
    rows = x.movedim(dim, 0).contiguous()
    n = rows.shape[0]
    sizes = [n] * t if split_sizes is None else [int(s) for s in split_sizes]
    r = dist.get_rank(group)
    if len(sizes) != t or sizes[r] != n:
        raise ContractError(
            "split_sizes",
            f"all_gather: rank {r} holds {n} rows but split_sizes is {sizes} for {t} ranks",
            "pass the same split_sizes on every rank, with this rank's own row count at its index",
        )
    if t == 1:
        return x.clone()
    if len(set(sizes)) == 1:
        out = rows.new_empty((t * n, *rows.shape[1:]))
        _all_gather_flat(out, rows, group=group)
    else:  # uneven shards: each rank sends its rows to every rank, the same bytes as a ring
        out = _all_to_all(rows.repeat(t, *[1] * (rows.dim() - 1)), group, sizes, [n] * t)
    return out.movedim(0, dim).contiguous()


class _TreeAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, algo):
        return _tree_all_reduce(x, group, algo)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, split_sizes):
        t = group_size(group, op="reduce_scatter")
        ctx.group, ctx.dim = group, dim
        ctx.sizes = _resolve_splits(x.shape[dim], t, split_sizes, "reduce_scatter")
        return _reduce_scatter(x, group, dim, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, split_sizes):
        out = _all_gather(x, group, dim, split_sizes)
        t = dist.get_world_size(group)
        ctx.group, ctx.dim = group, dim
        ctx.sizes = [x.shape[dim]] * t if split_sizes is None else list(split_sizes)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_sizes, in_sizes):
        ctx.group, ctx.out_sizes, ctx.in_sizes = group, out_sizes, in_sizes
        return _all_to_all(x, group, out_sizes, in_sizes)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.in_sizes, ctx.out_sizes), None, None, None


def tree_all_reduce(x: torch.Tensor, group: Group = None, *, algo: str = "gather") -> torch.Tensor:
    """Sum x over the group in the fixed pairwise tree of rank order; backward is the identity.

    The sum happens in x's dtype: pass fp32 partials (e.g. `kernels.linear_partial`) and cast
    after, so that a row-parallel shard plus this equals the unsharded kernel bit for bit.
    `algo="gather"` all-gathers the partials and sums them: one round, (t-1) x the message per
    rank, for latency-bound (decode-sized) messages. `algo="scatter_gather"` is `reduce_scatter`
    then `all_gather`: each element meets the same operands in the same tree, so the bits are
    identical, at a ring all-reduce's 2(t-1)/t x the message.
    """
    return _TreeAllReduce.apply(x, group, algo)


def reduce_scatter(
    x: torch.Tensor, group: Group = None, *, dim: int = 0, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice (along `dim`) of `tree_all_reduce(x)`, bit for bit; backward all-gathers.

    `split_sizes` cuts `dim` unevenly (same list on every rank); the default is
    `sequence_split_sizes`, equal shards when the dim divides.
    """
    return _ReduceScatter.apply(x, group, dim, split_sizes)


def all_gather(
    x: torch.Tensor, group: Group = None, *, dim: int = 0, split_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's x along `dim` in rank order; backward is the exact reduce_scatter.

    For uneven shards pass `split_sizes`, every rank's row count, the same list on every rank.
    """
    return _AllGather.apply(x, group, dim, split_sizes)


@dataclass(kw_only=True, slots=True)
class EpRoute:
    """Where `ep_dispatch` sent this rank's (token, slot) pairs, for `ep_combine` to return."""

    topk_ids: torch.Tensor
    """[T, k] global expert ids chosen for this rank's tokens."""
    order: torch.Tensor
    """[T*k] flat pair indices (token * k + slot), stably sorted by expert id: the send order."""
    send_counts: list[int]
    """Pairs sent to each EP rank."""
    recv_counts: list[int]
    """Rows received from each EP rank."""
    expert_ids: torch.Tensor
    """[R] global expert id of each received row; rows arrive by source rank, then expert id."""


def ep_dispatch(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, group: Group = None
) -> tuple[torch.Tensor, EpRoute]:
    """Send each token's row to the EP ranks owning its k experts (rank r owns a contiguous block
    of num_experts / t ids). Returns the received rows and the route back; deterministic: the
    order depends only on the expert ids and token positions."""
    t = group_size(group, op="ep_dispatch")
    if num_experts % t:
        raise ContractError(
            "shard_experts",
            f"ep_dispatch: {num_experts} experts do not divide over {t} EP ranks",
            "choose an EP size that divides the expert count",
        )
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send = torch.bincount(flat // (num_experts // t), minlength=t)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    rows = hidden.index_select(0, order // k)
    received = _AllToAll.apply(rows, group, recv_counts, send_counts)
    expert_ids = _all_to_all(flat[order], group, recv_counts, send_counts)
    route = EpRoute(
        topk_ids=topk_ids,
        order=order,
        send_counts=send_counts,
        recv_counts=recv_counts,
        expert_ids=expert_ids,
    )
    return received, route


def ep_combine(
    expert_out: torch.Tensor, topk_weights: torch.Tensor, route: EpRoute, group: Group = None
) -> torch.Tensor:
    """Return the expert outputs (rows in the order `ep_dispatch` delivered them) to their
    tokens, then `kernels.moe_combine`: weight x output in fp32, the pairwise tree over the
    token's slots in ascending expert id, one rounding to expert_out's dtype. Returns [T, H]."""
    back = _AllToAll.apply(expert_out, group, route.send_counts, route.recv_counts)
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    n_tok, k = route.topk_ids.shape
    pairs = back.index_select(0, inverse).view(n_tok, k, *back.shape[1:])
    return moe_combine(pairs, route.topk_ids, topk_weights)
