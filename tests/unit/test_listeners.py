"""The listener check (tests/listeners.py) sees what a process tree listens on, and can fail;
the project's launcher (`onpolicy.rendezvous.torchrun`) passes it where torchrun does not.

A planted 0.0.0.0 listener in a grandchild is reported, from the sampler and from the end-of-run
sample; a process that left the tree is found by its run id. A 2-rank gloo job through the
launcher listens (its store, gloo's pairs) on 127.0.0.1 only; the same job under
`torch.distributed.run`, the negative control, has its store on every interface.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from listeners import Listeners, _listening_from_netlink, _listening_from_proc

REPO = Path(__file__).resolve().parents[2]

PLANT = textwrap.dedent("""
    import os, socket, subprocess, sys, time
    if sys.argv[1] == "parent":  # the listener sits one level down: a grandchild of the watcher
        sys.exit(subprocess.call([sys.executable, __file__, "child", *sys.argv[2:]]))
    wild = socket.create_server(("0.0.0.0", 0))
    tame = socket.create_server(("127.0.0.1", 0))
    print(wild.getsockname()[1], tame.getsockname()[1], os.getpid(), flush=True)
    time.sleep(float(sys.argv[2]))
""")

WORKER = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    print(f"RANK {dist.get_rank()} SUM {t.item():g} PORT {os.environ['MASTER_PORT']}", flush=True)
    time.sleep(1.0)  # the job's listeners stay up for a few samples
    dist.barrier()
    dist.destroy_process_group()
""")


def _plant(tmp_path: Path, hold_s: float, *, stdout=subprocess.PIPE) -> subprocess.Popen:
    script = tmp_path / "plant.py"
    script.write_text(PLANT)
    return subprocess.Popen([sys.executable, str(script), "parent", str(hold_s)], stdout=stdout,
                            text=True)  # fmt: skip


def test_a_planted_wildcard_listener_is_reported(tmp_path, allow_wild_listeners):
    proc = _plant(tmp_path, 1.5)
    with Listeners(proc.pid) as seen:
        wild_port, tame_port, _ = map(int, proc.stdout.readline().split())
        proc.wait(timeout=60)
    ports = {(x.ip, x.port) for x in seen.seen}
    assert {("0.0.0.0", wild_port), ("127.0.0.1", tame_port)} <= ports, seen.seen
    assert {(x.ip, x.port) for x in seen.wild()} == {("0.0.0.0", wild_port)}
    with pytest.raises(AssertionError, match=rf"planted: listening beyond loopback: "
                       rf"0\.0\.0\.0:{wild_port} \(pid \d+ python"):  # fmt: skip
        seen.check("planted")


def test_the_netlink_dump_lists_what_proc_net_tcp_lists(allow_wild_listeners):
    """Every address family and kind of bind the check tells apart, from both readers: the
    same inodes, addresses and ports."""
    binds = [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1"),
             (socket.AF_INET6, "::"), (socket.AF_INET6, "::1")]  # fmt: skip
    servers = [socket.create_server((host, 0), family=fam) for fam, host in binds]
    mapped = socket.socket(socket.AF_INET6)  # an IPv4 address on an IPv6 socket
    mapped.bind(("::ffff:127.0.0.1", 0))
    mapped.listen()
    try:
        ours = {(host, s.getsockname()[1]) for (_, host), s in zip(binds, servers, strict=True)}
        ours.add(("::ffff:127.0.0.1", mapped.getsockname()[1]))
        for _ in range(20):  # other processes of the host open and close listeners meanwhile
            netlink, proc = _listening_from_netlink(), _listening_from_proc()
            if netlink == proc:
                break
        assert netlink == proc
        assert ours <= set(netlink.values()), (ours, netlink)
    finally:
        for s in [*servers, mapped]:
            s.close()


def test_the_end_of_run_sample_sees_what_still_listens(tmp_path, allow_wild_listeners):
    """No sampling in between (an hour's interval): only the closing sample can see it."""
    proc = _plant(tmp_path, 60)
    seen = Listeners(proc.pid, every=3600).start()
    wild_port, _, planted = map(int, proc.stdout.readline().split())
    try:
        assert not seen.wild()
        seen.stop()
        assert {(x.ip, x.port) for x in seen.wild()} == {("0.0.0.0", wild_port)}
    finally:
        os.kill(planted, 9)
        proc.wait(timeout=60)


def test_a_process_that_left_the_tree_is_found_by_its_run_id(tmp_path, allow_wild_listeners):
    from onpolicy.grpo.procs import RUN_ID_ENV

    run_id = uuid.uuid4().hex
    log, script = tmp_path / "plant.log", tmp_path / "plant.py"
    script.write_text(PLANT)
    # Started in a session of its own by a parent that exits at once: init adopts it.
    adopt = "import subprocess, sys; subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], 'w'), start_new_session=True)"  # noqa: E501
    subprocess.run([sys.executable, "-c", adopt, str(log), sys.executable, str(script), "child",
                    "60"], env={**os.environ, RUN_ID_ENV: run_id}, check=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while len(log.read_text().split()) < 3:
        assert time.monotonic() < deadline, "the planted process never listened"
        time.sleep(0.1)
    wild_port, _, planted = map(int, log.read_text().split())
    try:
        seen = Listeners(run_id=run_id)
        seen.sample()
        assert {(x.ip, x.port) for x in seen.wild()} == {("0.0.0.0", wild_port)}, seen.seen
        assert {x.pid for x in seen.seen} == {planted}
    finally:
        os.kill(planted, 9)


def _job_env() -> dict[str, str]:
    path = [str(REPO / "integration"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _ports(stdout: str) -> set[int]:
    return {int(line.split()[-1]) for line in stdout.splitlines() if line.startswith("RANK ")}


@pytest.mark.slow
def test_a_launcher_job_listens_on_loopback_only(tmp_path):
    from onpolicy.rendezvous import run_group, torchrun

    (tmp_path / "worker.py").write_text(WORKER)
    with Listeners(os.getpid()) as seen:
        p = run_group(torchrun(2, str(tmp_path / "worker.py")), env=_job_env(), timeout=300,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.count("SUM 3") == 2, p.stdout
    (store,) = _ports(p.stdout)
    # It was seen: the launcher's store, and gloo's pairs of both ranks (3 processes).
    assert ("127.0.0.1", store) in {(x.ip, x.port) for x in seen.seen}, seen.seen
    assert len({x.pid for x in seen.seen}) == 3, seen.seen
    seen.check("a 2-rank job through the launcher")


@pytest.mark.slow
def test_torchrun_the_negative_control_listens_everywhere(tmp_path, allow_wild_listeners):
    """The same job under torch.distributed.run, as the project launched it before: its store
    binds `::` whatever --master-addr says, and the check says so."""
    from onpolicy.rendezvous import free_port, loopback_env, run_group

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(worker)]  # fmt: skip
    with Listeners(os.getpid()) as seen:
        p = run_group(cmd, env={**_job_env(), **loopback_env()}, timeout=300,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    (store,) = _ports(p.stdout)
    wild = rf"listening beyond loopback: (::|0\.0\.0\.0):{store} "
    with pytest.raises(AssertionError, match=wild):
        seen.check("torchrun")
