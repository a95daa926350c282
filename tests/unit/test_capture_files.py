"""`--bisect`'s capture files are read without running code from them (`weights_only`)."""

from __future__ import annotations

import pickle

import pytest
import torch
from onpolicy import capture


class _Payload:
    """Unpickling this creates `marker`: what a planted capture file would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_capture_file_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save([{"layer": 0, "op": "attention", "shard": None, "positions": torch.arange(2),
                 "values": torch.zeros(2, 3), "x": _Payload(str(marker))}],
               tmp_path / "rollout-rank0.pt")  # fmt: skip
    with pytest.raises(pickle.UnpicklingError):
        capture.load(tmp_path, "rollout")
    assert not marker.exists()


def test_a_capture_file_of_tensors_and_plain_values_loads(tmp_path):
    rec = capture.Recorder()
    rec.add(0, "attention", torch.arange(3), torch.randn(3, 4))
    rec.save(tmp_path, "trainer", 0)
    points = capture.load(tmp_path, "trainer")
    assert list(points) == [(0, "attention")]
    assert torch.equal(points[0, "attention"].positions, torch.arange(3))
