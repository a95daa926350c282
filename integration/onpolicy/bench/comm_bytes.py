"""Bytes each rank sends for the SP reduce-scatter and the TP all-reduce, counted on a gloo world.

Ours (counted) is set against the textbook ring and the reference stack's exact
all-reduce-then-split (counted: its all-reduce is the same all-gather plus tree). Counting rule,
per rank: an all-gather of n bytes sends (t-1)*n (each shard must reach t-1 ranks; a ring
forwards exactly that); an all-to-all sends the bytes of every chunk bound for another rank.

    python -m onpolicy.bench.comm_bytes [--tokens 256] [--hidden 2048] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onpolicy import collectives


@dataclass(kw_only=True, slots=True)
class Row:
    """One group size's byte counts, per rank."""

    t: int
    """Group size."""
    message: int
    """Bytes of the full fp32 partial each rank holds (tokens x hidden x 4)."""
    ours_rs: int
    """Counted: all-to-all of per-shard partials, then a local tree."""
    ours_ar: int
    """Counted: all-gather of the partials, then the tree (algo="gather")."""
    ours_ar_scatter_gather: int
    """Counted: our reduce-scatter, then an all-gather of the sums (algo="scatter_gather")."""
    reference_rs: int
    """Counted: the reference stack's exact reduce-scatter, a tree all-reduce then a split."""
    exact: bool
    """Whether our RS equalled the AR's slice, and both AR algos agreed, bit for bit."""

    @property
    def ring_rs(self) -> int:
        """A ring reduce-scatter (not order-fixed): (t-1)/t of the message."""
        return self.message * (self.t - 1) // self.t

    @property
    def ring_ar(self) -> int:
        """A ring all-reduce (not order-fixed): reduce-scatter plus all-gather, 2(t-1)/t."""
        return 2 * self.message * (self.t - 1) // self.t


@contextlib.contextmanager
def counting(group: dist.ProcessGroup):
    """Count the bytes this rank sends through the collectives' two primitives."""
    sent = [0]
    t, me = dist.get_world_size(group), dist.get_rank(group)
    real_ag, real_a2a = collectives._all_gather_flat, dist.all_to_all_single

    def all_gather(out, inp, group=None):
        sent[0] += (t - 1) * inp.numel() * inp.element_size()
        return real_ag(out, inp, group=group)

    def all_to_all(out, inp, output_split_sizes=None, input_split_sizes=None, group=None):
        sizes = input_split_sizes or [inp.shape[0] // t] * t
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        sent[0] += (sum(sizes) - sizes[me]) * row
        return real_a2a(out, inp, output_split_sizes, input_split_sizes, group=group)

    with (
        mock.patch.object(collectives, "_all_gather_flat", all_gather),
        mock.patch.object(collectives.dist, "all_to_all_single", all_to_all),
    ):
        yield sent


def measure(group: dist.ProcessGroup, tokens: int, hidden: int) -> Row:
    """Run our RS, our AR and the reference's AR-then-split on one fp32 partial; count bytes."""
    t, me = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(me)
    x = torch.randn(tokens, hidden, generator=g) * 2.0 ** torch.randint(-20, 21, (1,), generator=g)
    with counting(group) as sent:
        rs = collectives.reduce_scatter(x, group)
    ours_rs = sent[0]
    with counting(group) as sent:
        ar = collectives.tree_all_reduce(x, group)
    ours_ar = sent[0]
    with counting(group) as sent:
        ar_sg = collectives.tree_all_reduce(x, group, algo="scatter_gather")
    ours_ar_sg = sent[0]
    with counting(group) as sent:
        ref = collectives.tree_all_reduce(x, group).tensor_split(t)[me]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))

    return Row(
        t=t,
        message=x.numel() * x.element_size(),
        ours_rs=ours_rs,
        ours_ar=ours_ar,
        ours_ar_scatter_gather=ours_ar_sg,
        reference_rs=sent[0],
        exact=same(rs, ref) and same(ar, ar_sg),
    )


def table(rows: list[Row]) -> str:
    """The markdown table for docs/benchmarks.md (MiB per rank)."""

    def mib(b: int) -> str:
        return f"{b / 2**20:.3f}"

    out = [
        "| t | message N | ring RS | **ours RS** | reference AR-then-split | ours RS / reference "
        "| ring AR | **ours AR gather** | **ours AR scatter_gather** | exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.t} | {mib(r.message)} | {mib(r.ring_rs)} | **{mib(r.ours_rs)}** | "
            f"{mib(r.reference_rs)} | {r.ours_rs / r.reference_rs:.3f} | {mib(r.ring_ar)} | "
            f"**{mib(r.ours_ar)}** | **{mib(r.ours_ar_scatter_gather)}** | "
            f"{'bitwise' if r.exact else 'DIFFERS'} |"
        )
    return "\n".join(out)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rows = []
    for t in args.worlds:
        group = dist.new_group(list(range(t)))
        if rank < t:
            rows.append(measure(group, args.tokens, args.hidden))
        dist.barrier()
    if rank == 0:
        print(f"fp32 partials of {args.tokens} tokens x {args.hidden} hidden; MiB sent per rank")
        print(table(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.bench.comm_bytes", description=__doc__)
    ap.add_argument("--tokens", type=int, default=256, help="sequence rows of the partial")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="group sizes")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(max(args.worlds), port, args), nprocs=max(args.worlds), join=True)


if __name__ == "__main__":
    main()
