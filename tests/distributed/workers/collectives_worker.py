"""Every collective check for one world size, in one gloo torchrun launch.

Each rank's inputs come from a seed and its rank, so every rank can rebuild every other rank's
inputs and compute the expected result locally. Rank 0 prints one line per check:
`RESULT <check> PASS` or `RESULT <check> FAIL <details>`, plus `NOTE` lines with measurements.
Comparisons are on the raw bits (an integer view), stricter than torch.equal (which calls
-0.0 and +0.0 equal).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
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

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    v = INT_VIEW[a.dtype]
    return torch.equal(a.contiguous().view(v), b.contiguous().view(v))


def n_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    v = INT_VIEW[a.dtype]
    return int((a.contiguous().view(v) != b.contiguous().view(v)).sum())


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


def check_ar(rank: int, t: int, notes: list[str]) -> list[str]:
    fails = []
    for seed, shape in [(1, (64, 33)), (2, (5,)), (3, (3, 4, 7))]:
        xs = all_inputs(seed, shape, t)
        for algo in ("gather", "scatter_gather"):
            y = tree_all_reduce(xs[rank], algo=algo)
            if not bits_equal(y, pairwise_tree_sum(xs)):
                fails.append(f"rank {rank} {algo} shape {shape}: != pairwise_tree_sum")
    return fails


def check_ar_identical(rank: int, t: int, notes: list[str]) -> list[str]:
    y = tree_all_reduce(adversarial(4, (64, 33), rank, t), algo="scatter_gather")
    gathered = torch.empty((t * y.numel(),))
    dist.all_gather_single(gathered, y.view(-1))
    gathered = gathered.view(t, *y.shape)
    return [f"rank {s} differs from rank 0" for s in range(t) if not bits_equal(gathered[s], y)]


def check_rs(rank: int, t: int, notes: list[str]) -> list[str]:
    fails = []
    n_uneven = 4 * t + 3
    with_empty = [0, *sequence_split_sizes(n_uneven, t - 1)]
    cases = [
        ("even", (4 * t, 33), 0, None),
        ("uneven default", (n_uneven, 17), 0, None),
        ("explicit with an empty shard", (n_uneven, 9), 0, with_empty),
        ("dim 1", (3, 2 * t + 1, 5), 1, None),
    ]  # fmt: skip
    for i, (name, shape, dim, sizes) in enumerate(cases):
        x = adversarial(10 + i, shape, rank, t)
        full = tree_all_reduce(x)
        n = shape[dim]
        cut = sizes or sequence_split_sizes(n, t)
        want = full.split(cut, dim=dim)[rank]
        got = reduce_scatter(x, dim=dim, split_sizes=sizes)
        if not bits_equal(got, want):
            fails.append(f"{name}: rank {rank} RS != AR slice ({n_differ(got, want)} differ)")
    return fails


def check_ag(rank: int, t: int, notes: list[str]) -> list[str]:
    fails = []
    xs = all_inputs(20, (3, 6), t)
    if not bits_equal(all_gather(xs[rank]), torch.cat(xs)):
        fails.append("even all_gather != cat")
    sizes = [r % 3 for r in range(t)]  # includes empty shards
    xs = [adversarial(21, (sizes[r], 5), r, t) for r in range(t)]
    if not bits_equal(all_gather(xs[rank], split_sizes=sizes), torch.cat(xs)):
        fails.append(f"uneven all_gather {sizes} != cat")
    xs = [adversarial(22, (2, r + 1, 3), r, t) for r in range(t)]
    got = all_gather(xs[rank], dim=1, split_sizes=[r + 1 for r in range(t)])
    if not bits_equal(got, torch.cat(xs, dim=1)):
        fails.append("dim-1 all_gather != cat")
    bf = [x.to(torch.bfloat16) for x in all_inputs(23, (4, 8), t)]
    if not bits_equal(all_gather(bf[rank]), torch.cat(bf)):
        fails.append("bf16 all_gather != cat")
    return [f"rank {rank}: {f}" for f in fails]


def check_backward(rank: int, t: int, notes: list[str]) -> list[str]:
    fails = []
    x = adversarial(30, (7, 6), rank, t).requires_grad_()
    g = adversarial(31, (7, 6), rank, t)
    tree_all_reduce(x).backward(g)
    if not bits_equal(x.grad, g):
        fails.append("tree_all_reduce backward is not the identity")

    n = 3 * t + 1
    sizes = sequence_split_sizes(n, t)
    x = adversarial(32, (n, 4), rank, t).requires_grad_()
    gs = [adversarial(33, (sizes[r], 4), r, t) for r in range(t)]
    reduce_scatter(x, split_sizes=sizes).backward(gs[rank])
    if not bits_equal(x.grad, torch.cat(gs)):
        fails.append("reduce_scatter backward is not the all-gather of the grads")

    x = adversarial(34, (sizes[rank], 4), rank, t).requires_grad_()
    gs = all_inputs(35, (n, 4), t)
    all_gather(x, split_sizes=sizes).backward(gs[rank])
    want = pairwise_tree_sum(gs).split(sizes)[rank]
    if not bits_equal(x.grad, want):
        fails.append("all_gather backward is not the exact reduce-scatter of the grads")
    return [f"rank {rank}: {f}" for f in fails]


def check_tp_linear(rank: int, t: int, notes: list[str]) -> list[str]:
    """Row-parallel linear: K split over t ranks, fp32 partials combined by the tree."""
    from onpolicy.kernels import (
        K_BLOCK,
        combine_partials,
        linear,
        linear_partial,
        row_parallel_exact,
    )

    k = K_BLOCK * 2 * t
    if not row_parallel_exact(k, t):
        return [f"row_parallel_exact({k}, {t}) is False for 2 blocks per shard"]
    m, n = 2 * t + 3, 24
    bf = torch.bfloat16
    x = adversarial(40, (m, k), 0, 1).to(bf)
    w = adversarial(41, (n, k), 0, 1).to(bf)
    bias = adversarial(42, (n,), 0, 1).to(bf)
    ks = k // t
    mine = slice(rank * ks, (rank + 1) * ks)
    partial = linear_partial(x[:, mine], w[:, mine])
    fails = []
    full = linear_partial(x, w)
    ar = tree_all_reduce(partial)
    if not bits_equal(ar, full):
        fails.append(f"tree_all_reduce of partials != unsharded fp32 ({n_differ(ar, full)} differ)")
    if not bits_equal(tree_all_reduce(partial, algo="scatter_gather"), full):
        fails.append("scatter_gather tree_all_reduce of partials != unsharded fp32")
    want = linear(x, w, bias)
    got = combine_partials([ar], bf, bias)
    if not bits_equal(got, want):
        fails.append(f"TP{t} linear != unsharded linear ({n_differ(got, want)} differ)")
    sizes = sequence_split_sizes(m, t)
    rs = reduce_scatter(partial, split_sizes=sizes)
    if not bits_equal(combine_partials([rs], bf, bias), want.split(sizes)[rank]):
        fails.append("SP reduce-scatter linear != slice of the unsharded linear")
    plain = partial.clone()
    dist.all_reduce(plain)
    if rank == 0:
        notes.append(
            f"tp_linear: TP{t} K={k}: plain dist.all_reduce of the partials differs from the "
            f"unsharded fp32 in {n_differ(plain, full)}/{full.numel()} elements"
        )
    return [f"rank {rank}: {f}" for f in fails]


def check_negative_control(rank: int, t: int, notes: list[str]) -> list[str]:
    """Plain gloo all_reduce / reduce_scatter on the same inputs: must differ at t >= 4; at t = 2
    a two-operand sum commutes, so they must agree."""
    x = adversarial(50, (4096,), rank, t)
    tree = tree_all_reduce(x)
    plain = x.clone()
    dist.all_reduce(plain)
    d_ar = n_differ(plain, tree)
    chunks = list(x.chunk(t))
    plain_rs = torch.empty_like(chunks[0])
    dist.reduce_scatter(plain_rs, chunks)
    d_rs = n_differ(plain_rs, reduce_scatter(x))
    counts = torch.tensor([d_ar, d_rs])
    dist.all_reduce(counts)
    if rank == 0:
        notes.append(
            f"negative_control: world {t}: plain dist.all_reduce differs from the tree in "
            f"{d_ar}/{x.numel()} elements on rank 0 ({int(counts[0])} over all ranks); "
            f"plain dist.reduce_scatter differs from ours in {int(counts[1])}/{x.numel()} "
            "elements over all ranks"
        )
    if t == 2:
        return [] if counts.sum() == 0 else [f"world 2: plain and tree disagree: {counts}"]
    if counts[0] == 0 or counts[1] == 0:
        return [f"world {t}: plain order agreed with the tree everywhere: {counts.tolist()}"]
    return []


def _expert(x: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor):
    """A row-independent stand-in expert: elementwise, so its bits do not depend on the batch."""
    return (x.float() * scale[ids] + shift[ids]).to(x.dtype)


def check_ep(rank: int, t: int, notes: list[str]) -> list[str]:
    """EP dispatch/combine at world t equals a one-token, all-experts-local reference, in fp32
    (where rounding shows every order change) and in bf16 (the model dtype)."""
    fails = []
    n_exp, k, h = 16, 4, 8
    g = torch.Generator().manual_seed(60)
    exps = torch.randint(-8, 9, (n_exp, h), generator=g)
    scale = torch.ldexp(torch.rand(n_exp, h, generator=g) + 0.5, exps)
    shift = torch.rand(n_exp, h, generator=g) - 0.5
    gr = torch.Generator().manual_seed(6100 + rank)
    n_tok = 16 + 3 * rank
    x32 = adversarial(62, (n_tok, h), rank, t)
    ids = torch.stack([torch.randperm(n_exp, generator=gr)[:k] for _ in range(n_tok)])
    w_exp = torch.randint(-12, 13, (n_tok, k), generator=gr)
    w = torch.ldexp(torch.rand(n_tok, k, generator=gr), w_exp)

    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        recv, route = ep_dispatch(x, ids, n_exp)
        if not bool(((route.expert_ids // (n_exp // t)) == rank).all()):
            fails.append("received a row for an expert this rank does not own")
        out = ep_combine(_expert(recv, route.expert_ids, scale, shift), w, route)
        recv2, route2 = ep_dispatch(x, ids, n_exp)
        if not (bits_equal(recv2, recv) and torch.equal(route2.order, route.order)):
            fails.append(f"{dtype}: dispatch is not reproducible")

        # One token at a time: weighted outputs in ascending expert id, then the pairwise tree.
        rows, rotated = [], []
        for i in range(n_tok):
            sel = sorted(range(k), key=lambda s: int(ids[i, s]))
            parts = [_expert(x[i], ids[i, s], scale, shift).float() * w[i, s] for s in sel]
            rows.append(pairwise_tree_sum(parts).to(dtype))
            rotated.append(pairwise_tree_sum(parts[1:] + parts[:1]).to(dtype))
        want = torch.stack(rows)
        if not bits_equal(out, want):
            fails.append(f"{dtype}: EP{t} combine != reference ({n_differ(out, want)} differ)")
        # The same outputs paired differently must change some fp32 bits, or these inputs
        # would not exercise the combine order at all.
        reordered = n_differ(torch.stack(rotated), want)
        if dtype == torch.float32 and reordered == 0:
            fails.append("inputs do not exercise the combine order (rotation changed nothing)")
        if rank == 0:
            notes.append(
                f"ep: world {t} {dtype}: summing the same expert outputs rotated by one slot "
                f"changes {reordered}/{want.numel()} outputs on rank 0"
            )

    # Backward: any correct gradient (the combine runs in fp32), compared against autograd of
    # the plain weighted sum on one rank.
    xd = x32.clone().requires_grad_()
    recv, route = ep_dispatch(xd, ids, n_exp)
    y = recv * scale[route.expert_ids] + shift[route.expert_ids]
    ep_combine(y, w, route).sum().backward()
    xr = x32.clone().requires_grad_()
    pairs = xr[:, None, :] * scale[ids] + shift[ids]
    ((pairs * w[..., None]).sum(1)).sum().backward()
    if not torch.allclose(xd.grad, xr.grad, rtol=1e-6, atol=0):
        fails.append("EP backward differs from the single-rank gradient")
    return [f"rank {rank}: {f}" for f in fails]


def check_non_power_of_2(rank: int, t: int, notes: list[str]) -> list[str]:
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


def check_comm_bytes(rank: int, t: int, notes: list[str]) -> list[str]:
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
    "negative_control": check_negative_control,
    "ep_dispatch_combine": check_ep,
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
        notes: list[str] = []
        try:
            fails = check(rank, t, notes)
        except Exception:
            fails = [f"rank {rank} raised:\n{traceback.format_exc()}"]
        everyone: list = [None] * t
        dist.all_gather_object(everyone, fails)
        if rank == 0:
            for note in notes:
                print(f"NOTE {note}")
            merged = [f for fs in everyone for f in fs]
            print(f"RESULT {name} " + ("PASS" if not merged else "FAIL " + " | ".join(merged)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
