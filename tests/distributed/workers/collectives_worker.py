"""Every collective check for one world size, in one gloo torchrun launch.

Each rank's inputs come from a seed and its rank, so every rank can rebuild every other rank's
inputs and compute the expected result locally. Bits are compared with `onpolicy.bits`.

Every exactness check runs its negative controls in the same harness, on the same inputs: the
plain op (gloo `dist.all_reduce`, `dist.reduce_scatter`, an all-reduce then a split,
`torch.distributed.nn`'s autograd collectives) or another summation order. A control asserts
that it changes outputs wherever an order can differ. Over ranks that needs t >= 4: at t = 2
the only orders are a + b and b + a, which IEEE addition makes equal, so there the control
asserts agreement instead. Orders over a token's k expert slots differ at every t.

Rank 0 prints, per check, `RESULT <check> PASS` or `RESULT <check> FAIL <details>`; per
control `CONTROL <check> <control> <differ> <total> <expect>` (outputs differing, summed over
all ranks; expect is `differ` or `agree`); and `NOTE` lines.
"""

from __future__ import annotations

import os
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from onpolicy import kernels as K
from onpolicy.bits import bitwise_equal, mismatch_report, n_differ
from onpolicy.collectives import (
    all_gather,
    ep_combine,
    ep_dispatch,
    reduce_scatter,
    sequence_split_sizes,
    tree_all_reduce,
)
from onpolicy.contract import ContractError
from onpolicy.kernels.tree import pairwise_tree_sum


def adversarial(seed: int, shape: tuple[int, ...], rank: int, world: int) -> torch.Tensor:
    """fp32 values where the summation order shows: wide exponents plus cancellations.

    Per element one of three patterns (chosen by the element, the same on every rank):
    - random signs and mantissas scaled by 2**randint(-20, 20);
    - alternating +-C across ranks (C up to 2**24) plus small noise: catastrophic cancellation;
    - +B on rank 0 and -B on the last rank with small values between: order decides what
      survives the big terms.
    """
    g_elem = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, 3, shape, generator=g_elem)
    big = torch.ldexp(torch.ones(shape), torch.randint(10, 25, shape, generator=g_elem))
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    wide = (torch.rand(shape, generator=g) * 2 - 1) * torch.ldexp(
        torch.ones(shape), torch.randint(-20, 21, shape, generator=g)
    )
    noise = torch.rand(shape, generator=g) * 2 - 1
    sign = 1.0 if rank % 2 == 0 else -1.0
    cancel = sign * big * (1 + torch.rand(shape, generator=g) * 2**-10) + noise
    ends = noise * 3 + (big if rank == 0 else -big if rank == world - 1 else 0)
    return torch.where(pattern == 0, wide, torch.where(pattern == 1, cancel, ends))


def all_inputs(seed: int, shape: tuple[int, ...], world: int) -> list[torch.Tensor]:
    return [adversarial(seed, shape, r, world) for r in range(world)]


def exact(got: torch.Tensor, want: torch.Tensor, what: str) -> list[str]:
    return [] if bitwise_equal(got, want) else [f"{what}: {mismatch_report(got, want)}"]


def flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def control(
    notes: list, name: str, plain: torch.Tensor, ours: torch.Tensor, *, differ: bool
) -> list[str]:
    """A negative control, called on every rank: `plain` is the plain op's result on this rank,
    `ours` the exact one. Counts differing outputs over all ranks (an int64 sum: exact) and
    asserts that some differ (`differ`) or that none do (an order that cannot differ here)."""
    counts = torch.tensor([n_differ(plain, ours), ours.numel()])
    dist.all_reduce(counts)
    d, n = counts.tolist()
    notes.append((name, d, n, "differ" if differ else "agree"))
    if differ and d == 0:
        return [f"control {name}: the plain op gave our bits on all {n} outputs"]
    if not differ and d:
        return [f"control {name}: {d} of {n} outputs differ where no order can differ"]
    return []


def orders_differ(t: int) -> bool:
    """Whether a plain t-rank sum must show another order: a two-operand sum commutes."""
    return t >= 4


def plain_all_reduce(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def plain_reduce_scatter(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """gloo's reduce-scatter of x's rows, cut by sizes."""
    rank = dist.get_rank()
    out = x.new_empty((sizes[rank], *x.shape[1:]))
    dist.reduce_scatter(out, [c.contiguous() for c in x.split(sizes)])
    return out


def check_ar(rank: int, t: int, notes: list) -> list[str]:
    fails = []
    cases = [(1, (64, 33)), (2, (5,)), (3, (3, 4, 7)), (4, (4096,))]
    ours, plain, ours_sg, plain_sg = [], [], [], []
    for seed, shape in cases:
        xs = all_inputs(seed, shape, t)
        want = pairwise_tree_sum(xs)
        for algo in ("gather", "scatter_gather"):
            got = tree_all_reduce(xs[rank], algo=algo)
            fails += exact(got, want, f"rank {rank} {algo} shape {shape} vs pairwise_tree_sum")
        ours.append(want)
        plain.append(plain_all_reduce(xs[rank]))
        if xs[rank].numel() % t == 0:  # the plain ring's reduce-scatter plus all-gather
            x = xs[rank].reshape(-1)
            part = plain_reduce_scatter(x, [x.numel() // t] * t)
            gathered = x.new_empty(x.shape)
            dist.all_gather_single(gathered, part)
            ours_sg.append(want)
            plain_sg.append(gathered)
    fails += control(notes, "plain_all_reduce", flat(plain), flat(ours), differ=orders_differ(t))
    fails += control(
        notes, "plain_reduce_scatter_all_gather", flat(plain_sg), flat(ours_sg),
        differ=orders_differ(t),
    )  # fmt: skip
    return fails


def check_ar_identical(rank: int, t: int, notes: list) -> list[str]:
    """The same bits on every rank; the control sums in an order that starts at the summing
    rank (as a ring's chunk owners do), which must give rank-dependent bits at t >= 4."""
    xs = all_inputs(5, (64, 33), t)
    y = tree_all_reduce(xs[rank], algo="scatter_gather")
    rotated = pairwise_tree_sum(xs[rank:] + xs[:rank])

    def gather(v: torch.Tensor) -> torch.Tensor:
        out = v.new_empty((t * v.numel(),))
        dist.all_gather_single(out, v.reshape(-1))
        return out.view(t, *v.shape)

    ys, rs = gather(y), gather(rotated)
    fails = [f"rank {s} vs rank 0: {mismatch_report(ys[s], ys[0])}"
             for s in range(t) if not bitwise_equal(ys[s], ys[0])]  # fmt: skip
    return fails + control(notes, "rank_rotated_order", rs[rank], rs[0], differ=orders_differ(t))


def check_rs(rank: int, t: int, notes: list) -> list[str]:
    fails = []
    n_uneven = 4 * t + 3
    with_empty = [0, *sequence_split_sizes(n_uneven, t - 1)]
    cases = [
        ("even", (4 * t, 33), 0, None),
        ("uneven default", (n_uneven, 17), 0, None),
        ("explicit with an empty shard", (n_uneven, 9), 0, with_empty),
        ("dim 1", (3, 2 * t + 1, 5), 1, None),
        ("wide even", (t * 512,), 0, None),
    ]  # fmt: skip
    ours, plain_rs, ours_rs, split = [], [], [], []
    for i, (name, shape, dim, sizes) in enumerate(cases):
        x = adversarial(10 + i, shape, rank, t)
        cut = sizes or sequence_split_sizes(shape[dim], t)
        want = tree_all_reduce(x).split(cut, dim=dim)[rank]
        got = reduce_scatter(x, dim=dim, split_sizes=sizes)
        fails += exact(got, want, f"{name}: rank {rank} RS vs AR slice")
        ours.append(got)
        split.append(plain_all_reduce(x).split(cut, dim=dim)[rank])
        if dim == 0:
            ours_rs.append(got)
            plain_rs.append(plain_reduce_scatter(x, cut))
    differ = orders_differ(t)
    fails += control(notes, "plain_reduce_scatter", flat(plain_rs), flat(ours_rs), differ=differ)
    fails += control(notes, "plain_all_reduce_then_split", flat(split), flat(ours), differ=differ)
    return fails


def check_ag(rank: int, t: int, notes: list) -> list[str]:
    """Data movement only: the plain all-gather gives the same bits; the control puts the
    shards in another rank order, which the comparison must see."""
    fails = []
    xs = all_inputs(20, (3, 6), t)
    got = all_gather(xs[rank])
    fails += exact(got, torch.cat(xs), f"rank {rank}: even all_gather vs cat")
    parts = [torch.empty_like(xs[rank]) for _ in range(t)]
    dist.all_gather(parts, xs[rank])
    fails += control(notes, "plain_all_gather", torch.cat(parts), got, differ=False)
    fails += control(notes, "rank_order_reversed", torch.cat(xs[::-1]), got, differ=True)
    sizes = [r % 3 for r in range(t)]  # includes empty shards
    xs = [adversarial(21, (sizes[r], 5), r, t) for r in range(t)]
    got = all_gather(xs[rank], split_sizes=sizes)
    fails += exact(got, torch.cat(xs), f"rank {rank}: uneven all_gather {sizes} vs cat")
    xs = [adversarial(22, (2, r + 1, 3), r, t) for r in range(t)]
    got = all_gather(xs[rank], dim=1, split_sizes=[r + 1 for r in range(t)])
    fails += exact(got, torch.cat(xs, dim=1), f"rank {rank}: dim-1 all_gather vs cat")
    bf = [x.to(torch.bfloat16) for x in all_inputs(23, (4, 8), t)]
    fails += exact(all_gather(bf[rank]), torch.cat(bf), f"rank {rank}: bf16 all_gather vs cat")
    return fails


def check_backward(rank: int, t: int, notes: list) -> list[str]:
    fails = []
    # tree_all_reduce <-> identity; torch.distributed.nn's all_reduce all-reduces the grads.
    g = adversarial(31, (7, 6), rank, t)
    x = adversarial(30, (7, 6), rank, t).requires_grad_()
    tree_all_reduce(x).backward(g)
    fails += exact(x.grad, g, f"rank {rank}: tree_all_reduce backward vs identity")
    xp = x.detach().clone().requires_grad_()
    with warnings.catch_warnings(action="ignore", category=FutureWarning):  # deprecated API
        dist_nn.all_reduce(xp).backward(g)
    fails += control(notes, "dist_nn_all_reduce_backward", xp.grad, x.grad, differ=True)

    # reduce_scatter <-> all-gather of the grads, in rank order.
    n = 3 * t + 1
    sizes = sequence_split_sizes(n, t)
    x = adversarial(32, (n, 4), rank, t).requires_grad_()
    gs = [adversarial(33, (sizes[r], 4), r, t) for r in range(t)]
    reduce_scatter(x, split_sizes=sizes).backward(gs[rank])
    fails += exact(x.grad, torch.cat(gs), f"rank {rank}: reduce_scatter backward vs all-gather")
    fails += control(notes, "grads_rank_order_reversed", torch.cat(gs[::-1]), x.grad, differ=True)

    # all_gather <-> the exact reduce-scatter of the grads.
    x = adversarial(34, (sizes[rank], 4), rank, t).requires_grad_()
    gs = all_inputs(35, (n, 4), t)
    all_gather(x, split_sizes=sizes).backward(gs[rank])
    fails += exact(
        x.grad, pairwise_tree_sum(gs).split(sizes)[rank], f"rank {rank}: all_gather backward"
    )
    # Even shards, for torch.distributed.nn's all_gather (gloo backward: all-to-all, torch.sum)
    # and for gloo's reduce-scatter of the grads.
    m = 512
    x = adversarial(36, (m, 4), rank, t).requires_grad_()
    gs = all_inputs(37, (t * m, 4), t)
    all_gather(x).backward(gs[rank])
    fails += exact(x.grad, pairwise_tree_sum(gs).split(m)[rank], f"rank {rank}: even AG backward")
    xp = x.detach().clone().requires_grad_()
    with warnings.catch_warnings(action="ignore", category=FutureWarning):
        torch.cat(dist_nn.all_gather(xp)).backward(gs[rank])
    differ = orders_differ(t)
    fails += control(notes, "dist_nn_all_gather_backward", xp.grad, x.grad, differ=differ)
    plain = plain_reduce_scatter(gs[rank], [m] * t)
    fails += control(notes, "plain_reduce_scatter_of_grads", plain, x.grad, differ=differ)
    return fails


def check_tp_linear(rank: int, t: int, notes: list) -> list[str]:
    """Row-parallel linear: K in S = t segments split over t ranks (one segment of 2 blocks
    each), fp32 partials combined by the tree."""
    k = K.K_BLOCK * 2 * t
    if not K.row_parallel_exact(k, t, t):
        return [f"row_parallel_exact({k}, {t}, {t}) is False for one segment per shard"]
    m, n = 2 * t + 3, 24
    bf = torch.bfloat16
    ks = k // t
    first, last, mine = slice(0, ks), slice(k - ks, k), slice(rank * ks, (rank + 1) * ks)
    x = adversarial(40, (m, k), 0, 1)
    w = adversarial(41, (n, k), 0, 1)
    # In even rows the first and last shards' partials cancel exactly (the same weights, the
    # negated inputs) and the shards between are 2**20 smaller: what survives depends on how
    # the ranks' partials are paired, visibly even after the bf16 cast.
    w[:, last] = w[:, first]
    x[::2, ks : k - ks] *= 2**-20
    x[::2, last] = -x[::2, first]
    x, w = x.to(bf), w.to(bf)
    bias = adversarial(42, (n,), 0, 1).to(bf)
    partial = K.linear_partial(x[:, mine], w[:, mine])
    full = K.linear_partial(x, w, segments=t)
    want = K.linear(x, w, bias, segments=t)
    sizes = sequence_split_sizes(m, t)
    fails = []
    ar = tree_all_reduce(partial)
    fails += exact(ar, full, f"rank {rank}: tree_all_reduce of partials vs unsharded fp32")
    fails += exact(tree_all_reduce(partial, algo="scatter_gather"), full, "scatter_gather")
    fails += exact(K.combine_partials([ar], bf, bias), want, f"TP{t} linear vs unsharded")
    rs = K.combine_partials([reduce_scatter(partial, split_sizes=sizes)], bf, bias)
    fails += exact(rs, want.split(sizes)[rank], f"rank {rank}: SP reduce-scatter linear")

    differ = orders_differ(t)
    plain = plain_all_reduce(partial)
    fails += control(notes, "plain_all_reduce_fp32", plain, full, differ=differ)
    plain_out = K.combine_partials([plain], bf, bias)
    fails += control(notes, "plain_all_reduce_bf16_out", plain_out, want, differ=differ)
    plain_rs = K.combine_partials([plain_reduce_scatter(partial, sizes)], bf, bias)
    fails += control(notes, "plain_reduce_scatter", plain_rs, rs, differ=differ)
    # The tree on bf16-rounded shard outputs (a row-parallel layer that rounds before its
    # all-reduce) rounds inside the sum: wrong at every t.
    rounded = tree_all_reduce(partial.to(bf)).float() + bias.float()
    fails += control(notes, "tree_of_bf16_rounded_partials", rounded.to(bf), want, differ=True)
    return fails


EP_CONFIGS = [(16, 4), (32, 8)]
"""(experts, top-k): k >= 4, so a token's combine tree has at least two levels."""


def ep_weights(n_exp: int, h: int, inter: int, dtype: torch.dtype, seed: int):
    """Router and SwiGLU expert weights built so that the combine order shows in bf16 too.

    Experts j and j + E/2, for j < E/4, are mirrors: the same gate row (so the same routing
    weight; the stable top-k keeps both) and down projections of opposite sign, so their
    weighted outputs cancel exactly and only their order against the token's other slots is
    left. Their down projections are scaled by 2**18..2**21, the other experts' by
    2**-8..2**3: the small slots are swallowed by a big one or kept, depending on the pairing.
    """
    g = torch.Generator().manual_seed(seed)
    mirrored = torch.arange(n_exp // 4)
    gate = torch.randn(n_exp, h, generator=g)
    gate[mirrored + n_exp // 2] = gate[mirrored]
    w_gate = torch.randn(n_exp, inter, h, generator=g) * h**-0.5
    w_up = torch.randn(n_exp, inter, h, generator=g) * h**-0.5
    exps = torch.randint(-8, 4, (n_exp,), generator=g)
    exps[mirrored] = torch.randint(18, 22, (len(mirrored),), generator=g)
    w_down = torch.randn(n_exp, h, inter, generator=g) * torch.exp2(exps.float())[:, None, None]
    for wt in (w_gate, w_up):
        wt[mirrored + n_exp // 2] = wt[mirrored]
    w_down[mirrored + n_exp // 2] = -w_down[mirrored]
    return tuple(wt.to(dtype) for wt in (gate, w_gate, w_up, w_down))


def ep_tokens(rank: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank r's tokens: 24 + 3r rows (uneven across ranks), mantissas scaled by 2**-3..2**2."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n_tok = 24 + 3 * rank
    scale = torch.exp2(torch.randint(-3, 3, (n_tok, 1), generator=g).float())
    return (torch.randn(n_tok, h, generator=g) * scale).to(dtype)


def weighted_slots(outputs, ids, weights):
    """[T, k, H] fp32 weight x output, slots in ascending expert id (moe_combine's operands)."""
    order = torch.sort(ids, dim=-1, stable=True).indices
    y = outputs.gather(1, order[..., None].expand_as(outputs)).float()
    return weights.gather(1, order).float()[..., None] * y


def tree_over_slots(products: torch.Tensor) -> torch.Tensor:
    return pairwise_tree_sum(products.transpose(0, 1))


def ep_case(rank: int, t: int, n_exp: int, k: int, dtype, notes: list) -> list[str]:
    h, inter = 16, 32
    what = f"E{n_exp}_k{k}_{str(dtype).removeprefix('torch.')}"
    gate, w_gate, w_up, w_down = ep_weights(n_exp, h, inter, dtype, seed=60 + k)
    xs = [ep_tokens(r, h, dtype, seed=61 + k) for r in range(t)]
    x = xs[rank]
    ids, weights = K.moe_route(x, gate, k)
    per_rank = n_exp // t
    local = list(range(rank * per_rank, (rank + 1) * per_rank))
    fails = []

    recv, route = ep_dispatch(x, ids, n_exp)
    if not bool(((route.expert_ids // per_rank) == rank).all()):
        fails.append(f"{what}: received a row for an expert this rank does not own")
    recv2, route2 = ep_dispatch(x, ids, n_exp)
    if not (bitwise_equal(recv2, recv) and bitwise_equal(route2.order, route.order)):
        fails.append(f"{what}: dispatch is not reproducible")
    expert_out = K.moe_expert_outputs(recv, route.expert_ids[:, None], w_gate, w_up, w_down,
                                      local_experts=local)[:, 0]  # fmt: skip
    got = ep_combine(expert_out, weights, route)

    # The single-rank MoE, on this rank's tokens alone and on every rank's tokens at once.
    fails += exact(got, K.moe(x, gate, w_gate, w_up, w_down, k), f"{what}: EP{t} vs 1-rank MoE")
    x_all = torch.cat(xs)
    first = sum(len(xr) for xr in xs[:rank])
    want = K.moe(x_all, gate, w_gate, w_up, w_down, k)[first : first + len(x)]
    fails += exact(got, want, f"{what}: EP{t} vs 1-rank MoE of all ranks' tokens")

    # Controls: the same expert outputs (every slot of this rank's tokens, computed locally),
    # summed in another order.
    slot_out = K.moe_expert_outputs(x, ids, w_gate, w_up, w_down)
    products = weighted_slots(slot_out, ids, weights)
    fails += exact(tree_over_slots(products).to(dtype), want, f"{what}: local combine")
    rotated = tree_over_slots(products.roll(1, dims=1)).to(dtype)
    fails += control(notes, f"slots_rotated_{what}", rotated, got, differ=True)
    router = pairwise_tree_sum((weights[..., None] * slot_out.float()).transpose(0, 1))
    fails += control(notes, f"router_slot_order_{what}", router.to(dtype), got, differ=True)
    # EP without dispatch: each rank combines its own experts' slots for every token (the
    # others zero) and a plain all-reduce adds the ranks' fp32 partials.
    ids_all, weights_all = K.moe_route(x_all, gate, k)
    mine = K.moe_expert_outputs(x_all, ids_all, w_gate, w_up, w_down, local_experts=local)
    partial = tree_over_slots(weighted_slots(mine, ids_all, weights_all))
    summed = plain_all_reduce(partial)[first : first + len(x)].to(dtype)
    fails += control(notes, f"rank_partials_all_reduce_{what}", summed, got, differ=True)
    return [f"rank {rank}: {f}" for f in fails]


def check_ep(rank: int, t: int, notes: list) -> list[str]:
    """EP dispatch/combine with the exact SwiGLU experts equals the single-rank MoE, in fp32
    and bf16; the controls sum the same expert outputs in other orders."""
    fails = []
    for n_exp, k in EP_CONFIGS:
        for dtype in (torch.float32, torch.bfloat16):
            fails += ep_case(rank, t, n_exp, k, dtype, notes)
    return fails


def check_ep_backward(rank: int, t: int, notes: list) -> list[str]:
    """The EP gradient is a correct gradient (the reverse all-to-alls return each row's grad to
    its token): close to the single-rank MoE's. Gradients are not claimed to be exact."""
    n_exp, k, h, inter = 16, 4, 16, 32
    g = torch.Generator().manual_seed(70)
    gate = torch.randn(n_exp, h, generator=g)
    w_gate, w_up = (torch.randn(n_exp, inter, h, generator=g) * h**-0.5 for _ in range(2))
    w_down = torch.randn(n_exp, h, inter, generator=g) * inter**-0.5
    x0 = torch.randn(20 + 3 * rank, h, generator=torch.Generator().manual_seed(71 + rank))
    per_rank = n_exp // t
    local = list(range(rank * per_rank, (rank + 1) * per_rank))

    xd = x0.clone().requires_grad_()
    ids, weights = K.moe_route(xd, gate, k)
    recv, route = ep_dispatch(xd, ids, n_exp)
    out = K.moe_expert_outputs(recv, route.expert_ids[:, None], w_gate, w_up, w_down,
                               local_experts=local)[:, 0]  # fmt: skip
    ep_combine(out, weights, route).sum().backward()
    xr = x0.clone().requires_grad_()
    K.moe(xr, gate, w_gate, w_up, w_down, k).sum().backward()
    if not torch.allclose(xd.grad, xr.grad, rtol=1e-5, atol=1e-6):
        err = float((xd.grad - xr.grad).abs().max())
        return [f"rank {rank}: EP backward differs from the single-rank gradient (max {err})"]
    return []


def check_non_power_of_2(rank: int, t: int, notes: list) -> list[str]:
    sub = dist.new_group([0, 1, 2])
    if rank > 2:
        return []
    fails = []
    x = torch.ones(6, 2)
    calls = {
        "tree_all_reduce": lambda: tree_all_reduce(x, sub),
        "reduce_scatter": lambda: reduce_scatter(x, sub),
        "all_gather": lambda: all_gather(x, sub),
        "ep_dispatch": lambda: ep_dispatch(x, torch.zeros(6, 1, dtype=torch.long), 6, sub),
    }
    for name, call in calls.items():
        try:
            call()
            fails.append(f"{name} accepted a group of 3")
        except ContractError as e:
            if e.rule != "power_of_2_groups" or "3 ranks" not in str(e):
                fails.append(f"{name}: wrong error {e}")
            elif rank == 0 and name == "tree_all_reduce":
                notes.append(f"non_power_of_2: {str(e)!r}")
    return [f"rank {rank}: {f}" for f in fails]


def check_comm_bytes(rank: int, t: int, notes: list) -> list[str]:
    """The benchmark's byte counts on this world: RS sends a ring's (t-1)/t of the message."""
    from onpolicy.bench.comm_bytes import measure

    row = measure(dist.group.WORLD, 4 * t, 64)
    want = {
        "ours_rs": row.ring_rs,
        "ours_ar": (t - 1) * row.message,
        "ours_ar_scatter_gather": row.ring_ar,
        "reference_rs": (t - 1) * row.message,
    }
    got = {k: getattr(row, k) for k in want}
    fails = [] if got == want and row.exact else [f"rank {rank}: {got} != {want} ({row})"]
    if rank == 0:
        notes.append(f"comm_bytes: world {t}: {got}")
    return fails


CHECKS = {
    "ar_matches_tree": check_ar,
    "ar_identical_on_ranks": check_ar_identical,
    "rs_equals_ar_slice": check_rs,
    "all_gather_exact": check_ag,
    "backward_pairs": check_backward,
    "tp_linear": check_tp_linear,
    "ep_dispatch_combine": check_ep,
    "ep_backward": check_ep_backward,
    "non_power_of_2_refused": check_non_power_of_2,
    "comm_bytes": check_comm_bytes,
}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, t = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("ONPOLICY_CHECKS")
    for name, check in CHECKS.items():
        if only and name not in only.split(","):
            continue
        if name == "non_power_of_2_refused" and t < 4:
            continue
        notes: list = []
        try:
            fails = check(rank, t, notes)
        except Exception:
            fails = [f"rank {rank} raised:\n{traceback.format_exc()}"]
        everyone: list = [None] * t
        dist.all_gather_object(everyone, fails)
        if rank == 0:
            for note in notes:
                if isinstance(note, tuple):
                    print("CONTROL " + " ".join(str(v) for v in (name, *note)))
                else:
                    print(f"NOTE {note}")
            merged = [f for fs in everyone for f in fs]
            print(f"RESULT {name} " + ("PASS" if not merged else "FAIL " + " | ".join(merged)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
