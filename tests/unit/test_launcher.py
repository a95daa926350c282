"""The local job launcher (`onpolicy.rendezvous.torchrun`) and its bounded wait (`run_group`):
a failed rank stops the others and its status is the job's; a job past its bound prints every
process's stack before it is killed. No torch in the ranks: these take seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RANKS = """
import os, pathlib, sys, time
rank, here = int(os.environ["RANK"]), pathlib.Path(__file__).parent
print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
      f"gloo {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
(here / f"up{rank}").touch()
if rank == 1:  # once every rank has printed
    deadline = time.monotonic() + 120
    while len(list(here.glob("up*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    path = [str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def test_a_failed_rank_stops_the_others_and_gives_the_job_its_status(tmp_path):
    from onpolicy.rendezvous import run_group, torchrun

    (tmp_path / "ranks.py").write_text(RANKS)
    t0 = time.monotonic()
    p = run_group(torchrun(3, str(tmp_path / "ranks.py")), env=_env(), timeout=300,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    took = time.monotonic() - t0
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "rank 1 of 3 exited 3; stopping the others" in p.stderr, p.stderr
    lines = sorted(x for x in p.stdout.splitlines() if x.startswith("rank "))
    assert [x.split(" master")[0] for x in lines] == [f"rank {r} of 3 local {r}" for r in range(3)]
    assert all(" master 127.0.0.1:" in x and x.endswith(" gloo lo") for x in lines), lines
    assert took < 120, f"the surviving ranks (sleeping 600 s) held the job {took:.0f} s"


def test_a_job_past_its_bound_prints_its_stacks_then_is_killed(tmp_path):
    from onpolicy.rendezvous import run_group

    hang = "import time\ndef wait_forever():\n    time.sleep(600)\n"
    (tmp_path / "hang.py").write_text(hang + "print('up', flush=True)\nwait_forever()\n")
    cmd = [sys.executable, str(tmp_path / "hang.py")]
    try:
        run_group(cmd, env=_env(PYTHONFAULTHANDLER="1"), timeout=8, cwd=tmp_path,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        assert e.output == "up\n", e.output
        assert "Fatal Python error: Aborted" in e.stderr, e.stderr
        assert "in wait_forever" in e.stderr, e.stderr
    else:
        raise AssertionError("the job ended within its bound")
    assert not list(tmp_path.glob("core*")), "a core file was written"
