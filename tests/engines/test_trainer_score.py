"""What a trainer rank's `score` hands the driver unpickles without megatron-core.

megatron.core replaces torch's `storage._load_from_bytes` with its own, so a tensor pickled in
a trainer's process names megatron.core, and the driver, unpickling it, imported all of
megatron.core at step 1's score (3 s on this CPU). `score` returns numpy arrays instead. One
trainer rank at world 1 on CPU/gloo (the `trainer_runs` fixture's "nothing" run) pickles its
result; a fresh process loads it. Control: the same values as torch tensors, pickled in the
same process, import megatron.core when loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LOAD = """
import json, pickle, sys
value = pickle.loads(open(sys.argv[1], "rb").read())
print(json.dumps({"megatron": "megatron.core" in sys.modules,
                  "types": sorted({type(v).__module__ + "." + type(v).__name__
                                   for k in ("logprobs", "routes") for v in value[k]}),
                  "dtypes": [str(value["logprobs"][0].dtype), str(value["routes"][0].dtype)],
                  "shapes": [list(v.shape) for v in value["routes"]]}))
"""


def load(path: Path) -> dict:
    """What a fresh process (the driver's imports: torch, not megatron) finds loading `path`."""
    proc = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_score_loads_without_megatron(trainer_runs):
    got = load(trainer_runs["score_out"] / "score.pkl")
    assert got["megatron"] is False, got
    assert got["types"] == ["numpy.ndarray"], got
    assert got["dtypes"] == ["float32", "int32"], got
    assert len(got["shapes"]) == 4 and all(len(s) == 3 for s in got["shapes"]), got


def test_negative_control_the_same_values_as_tensors_import_megatron(trainer_runs):
    got = load(trainer_runs["score_out"] / "score_torch.pkl")
    assert got["types"] == ["torch.Tensor"], got
    assert got["megatron"] is True, got
