"""The run's process marking: teardown reaps the run's processes and never the ones above it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from onpolicy.grpo.procs import RUN_ID_ENV, ancestors, run_processes

REPO = Path(__file__).resolve().parents[2]

# The "driver": it starts a process of the run (a sleeper, which inherits the id), then reaps.
DRIVER = textwrap.dedent("""
    import json, subprocess, sys
    from onpolicy.grpo.procs import reap
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left = reap(sys.argv[1], grace_s=0.2)
    child.wait(10)
    print(json.dumps({"child": child.pid, "left": left, "child_rc": child.returncode}))
""")
# A shell-like parent that carries the run id too (as `ONPOLICY_RUN_ID=x nox -s e2e` would):
# it runs the driver and reports whether it outlived the reap.
PARENT = textwrap.dedent("""
    import subprocess, sys
    p = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True,
                       text=True, timeout=60)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    sys.exit(p.returncode)
""")


def test_reap_kills_the_runs_processes_and_spares_the_drivers_ancestors():
    run_id = uuid.uuid4().hex
    env = {**os.environ, RUN_ID_ENV: run_id,
           "PYTHONPATH": os.pathsep.join([str(REPO / "integration"),
                                          os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", PARENT, DRIVER, run_id], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    # Reaping the parent would have ended it by SIGKILL (-9) before it printed anything.
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    got = json.loads(p.stdout)
    assert got["child_rc"] == -9, got
    assert len(got["left"]) == 1 and got["left"][0].startswith(f"{got['child']} "), got
    assert run_processes(run_id) == []


def test_ancestors_walks_up_to_init():
    code = (
        "import json; from onpolicy.grpo.procs import ancestors; "
        "print(json.dumps(sorted(ancestors())))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    child = set(json.loads(p.stdout))
    # the child, and this process above it; init is never counted
    assert os.getpid() in child and len(child - ancestors()) == 1 and 1 not in child, p
    assert os.getpid() in ancestors()


def test_the_driver_takes_a_fresh_run_id_unless_one_is_named(monkeypatch):
    from onpolicy.grpo.config import load_e2e_config
    from onpolicy.grpo.driver import Driver

    monkeypatch.setenv(RUN_ID_ENV, "inherited")
    e = load_e2e_config(REPO / "configs" / "tiny-cpu.toml")
    fresh = Driver(e).cluster.run_id
    assert fresh != "inherited" and len(fresh) == 32 and os.environ[RUN_ID_ENV] == fresh
    assert Driver(e).cluster.run_id != fresh
    assert Driver(e, run_id="named").cluster.run_id == "named"
    assert os.environ[RUN_ID_ENV] == "named"


def test_run_group_kills_the_whole_group_past_its_timeout(tmp_path):
    """A job that started a child of its own: past the timeout both are gone (torchrun and its
    ranks, a worker and what it started), and what the job printed comes with the error."""
    import pytest
    from onpolicy.rendezvous import run_group

    pid_file = tmp_path / "child.pid"
    job = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(120)
    """)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_group([sys.executable, "-c", job], env=dict(os.environ), timeout=5,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert e.value.output == "started\n"
    child = int(pid_file.read_text())
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert run_group([sys.executable, "-c", "print(7)"], env=dict(os.environ), timeout=60,
                     stdout=subprocess.PIPE, text=True).stdout == "7\n"  # fmt: skip


def test_group_members_lists_the_live_processes_of_a_group_not_its_zombies():
    from onpolicy.rendezvous import group_members

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True)  # fmt: skip
    try:
        assert group_members(p.pid) == [p.pid]
        assert group_members(os.getpgid(0)) != [] and p.pid not in group_members(os.getpgid(0))
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert group_members(p.pid) == []  # a zombie, not yet waited for: done
    finally:
        p.kill()
        p.wait()
