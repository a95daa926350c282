"""The one parallel layout: degrees derived once, and every rank's coordinates in megatron-core's
"tp-cp-ep-dp-pp" order (the Megatron engine tests check parallel_state agrees at each layout)."""

from __future__ import annotations

import pytest
from onpolicy.layout import ParallelLayout


def test_dp_is_derived_once_and_an_explicit_dp_is_kept():
    assert ParallelLayout(world=8, tp=2, pp=2).dp == 2
    assert ParallelLayout(world=8, tp=2, pp=2, dp=4).dp == 4  # the contract's world_layout refuses
    assert ParallelLayout(world=5, tp=2).dp == 0  # does not divide: left for the rule to name
    layout = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
    assert layout.degrees() == {"tp": 2, "pp": 2, "ep": 2, "etp": 1, "sp": True, "dp": 2,
                                "edp": 2}  # fmt: skip


def test_published_layout_coordinates():
    layout = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
    coords = [layout.coords(g) for g in range(8)]
    assert coords[0] == {"tp": 0, "dp": 0, "pp": 0, "etp": 0, "ep": 0, "edp": 0}
    assert coords[1] == {"tp": 1, "dp": 0, "pp": 0, "etp": 0, "ep": 1, "edp": 0}
    assert coords[2] == {"tp": 0, "dp": 1, "pp": 0, "etp": 0, "ep": 0, "edp": 1}
    assert coords[7] == {"tp": 1, "dp": 1, "pp": 1, "etp": 0, "ep": 1, "edp": 1}
    assert layout.layers(5, 48) == range(24, 48) and layout.experts(5, 128) == range(64, 128)
    # Each (pp, tp, dp) cell is one rank, and each stage's experts are held edp times over.
    assert len({(c["pp"], c["tp"], c["dp"]) for c in coords}) == 8
    assert len({(c["pp"], c["ep"], c["edp"]) for c in coords}) == 8


def test_bad_ranks_and_splits_are_refused_by_name():
    layout = ParallelLayout(world=4, tp=2, ep=2)
    with pytest.raises(ValueError, match="rank 4 is outside the training world of 4 ranks"):
        layout.tp_rank(4)
    with pytest.raises(ValueError, match="7 experts do not split over EP = 2"):
        layout.experts(0, 7)
    with pytest.raises(ValueError, match="3 layers do not split into PP = 2"):
        ParallelLayout(world=4, pp=2).layers(0, 3)


def test_name_and_parse_round_trip():
    published = ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
    assert published.name() == "world8-tp2-pp2-ep2-sp"
    assert published.name(full=True) == "world8-tp2-pp2-ep2-etp1-sp"
    assert ParallelLayout(world=1).name(full=True) == "world1-tp1-pp1-ep1-etp1"
    layouts = [
        published,
        ParallelLayout(world=1),
        ParallelLayout(world=4, tp=2, ep=2, etp=2),
        ParallelLayout(world=8, pp=2, ep=4),
        ParallelLayout(world=4, tp=2, cp=2, sp=True),
    ]
    for layout in layouts:
        assert ParallelLayout.parse(layout.name()) == layout, layout
        assert ParallelLayout.parse(layout.name(full=True)) == layout, layout
    # Tokens in any order; an unnamed world is tp x pp x cp.
    assert ParallelLayout.parse("sp-tp2-world8-ep2-pp2") == published
    assert ParallelLayout.parse("tp2-sp") == ParallelLayout(world=2, tp=2, sp=True)


@pytest.mark.parametrize(
    ("text", "token", "what"),
    [("world8-xp2", "xp2", "unknown"), ("tp2-tp2-sp", "tp2", "repeated"), ("", "", "unknown"),
     ("world8--sp", "", "unknown"), ("tpx", "tpx", "unknown"), ("sp-sp", "sp", "repeated")],
)  # fmt: skip
def test_parse_names_the_bad_token(text, token, what):
    with pytest.raises(ValueError, match=f"layout {text!r}: token {token!r} is {what}"):
        ParallelLayout.parse(text)


def test_command_line_arguments(monkeypatch):
    import argparse

    ap = argparse.ArgumentParser()
    ParallelLayout.add_arguments(ap)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ap.parse_args(["--tp", "2", "--pp", "2", "--ep", "2", "--sp", "--world", "8"])
    assert ParallelLayout.from_args(args) == ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True)
    assert ParallelLayout.from_args(ap.parse_args([])) == ParallelLayout(world=1)
    assert ParallelLayout.from_args(ap.parse_args(["--tp", "2"])).world == 2  # tp x pp x cp
    monkeypatch.setenv("WORLD_SIZE", "4")  # a worker torchrun started
    args = ap.parse_args(["--tp", "2", "--etp", "2", "--ep", "2"])
    assert ParallelLayout.from_args(args) == ParallelLayout(world=4, tp=2, ep=2, etp=2)


def test_cli_args_are_read_back_whole():
    import argparse

    for layout in (
        ParallelLayout(world=8, tp=2, pp=2, ep=2, sp=True),
        ParallelLayout(world=4, tp=2, etp=2, ep=2, sp=True),
        ParallelLayout(world=1),
    ):
        ap = argparse.ArgumentParser()
        ParallelLayout.add_arguments(ap)
        assert ParallelLayout.from_args(ap.parse_args(layout.cli_args())) == layout
