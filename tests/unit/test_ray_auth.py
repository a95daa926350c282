"""Token authentication of the run's Ray cluster (`onpolicy.grpo.ray_auth`).

The head is the one `Cluster._ray_init` starts for a run. Against it: raw gRPC calls to the
GCS, the raylet and an actor's worker, `ray.init` from another process, and a `Cluster` joining
it from another process; each without a token, with a wrong one, with the one in
~/.ray/auth_token (a decoy written there first), and with the run's. The negative control: the
same probes against a head started under an inherited RAY_AUTH_MODE=disabled with
`run.ray_auth = false` are all let in, and a joining `Cluster` refuses that head.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from onpolicy.contract import ContractError
from onpolicy.grpo import ray_auth
from onpolicy.grpo.cluster import Cluster, RunError
from onpolicy.grpo.config import load_e2e_config
from onpolicy.grpo.e2e import main
from onpolicy.grpo.procs import RUN_ID_ENV
from onpolicy.rendezvous import run_group

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
DECOY = "d" * 64
"""The token in ~/.ray/auth_token (the test's HOME): Ray's default, which the run must not use."""

pytestmark = pytest.mark.timeout(300)

CLIENT = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("JOINED", ray.cluster_resources().get("CPU"))
"""
"""`ray.init` of another process; it prints JOINED once the head let it in."""

JOIN = """
import sys
from onpolicy.grpo.cluster import Cluster, RunError
from onpolicy.grpo.config import load_e2e_config
e = load_e2e_config(sys.argv[1], {"run.ray_address": sys.argv[2], "run.out": sys.argv[3]})
c = Cluster(e, run_id="join", authkey="0")
try:
    c._ray_init()
    import ray
    print("JOINED", ray.cluster_resources().get("CPU"))
except RunError as err:
    print("REFUSED", err.code, err)
finally:
    c.teardown(graceful=False)
"""
"""A run's `Cluster` joining the head as run.ray_address."""


@pytest.fixture
def env(tmp_path, monkeypatch) -> Path:
    """No Ray auth variable inherited; HOME a fresh folder whose ~/.ray/auth_token is DECOY; a
    run id that Ray's processes inherit (teardown reaps by it); no OOM killing of Ray workers.
    Everything restored after."""
    for k in (*ray_auth.ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(DECOY)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(RUN_ID_ENV, f"test-ray-auth-{os.getpid()}")
    # Ray's memory monitor kills workers when the host (shared with other jobs) is nearly full.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    return home


def _config(out: Path, **run):
    overrides = {"run.out": str(out)} | {f"run.{k}": v for k, v in run.items()}
    return load_e2e_config(TINY, overrides)


@pytest.fixture
def head(env, tmp_path):
    """`start(**run)`: the run's Ray head, started by `Cluster._ray_init`; shut down (and any
    process of it left killed) after the test."""
    started = []

    def start(**run) -> Cluster:
        out = tmp_path / "run"
        out.mkdir()
        c = Cluster(_config(out, **run), run_id=os.environ[RUN_ID_ENV], authkey="0")
        started.append(c)
        c._ray_init()
        assert c.started_ray
        return c

    yield start
    for c in started:
        c.teardown(graceful=False)


def _grpc(address: str, server: str, token: str | None) -> str:
    """One call to a Ray gRPC server with `token` (None: no authorization header): "OK" or the
    status code's name."""
    import grpc
    from ray.core.generated import (
        core_worker_pb2,
        core_worker_pb2_grpc,
        gcs_service_pb2,
        gcs_service_pb2_grpc,
        node_manager_pb2,
        node_manager_pb2_grpc,
    )

    calls = {
        "gcs": (gcs_service_pb2_grpc.NodeInfoGcsServiceStub, "GetClusterId",
                gcs_service_pb2.GetClusterIdRequest()),
        "raylet": (node_manager_pb2_grpc.NodeManagerServiceStub, "GetNodeStats",
                   node_manager_pb2.GetNodeStatsRequest()),
        "worker": (core_worker_pb2_grpc.CoreWorkerServiceStub, "GetCoreWorkerStats",
                   core_worker_pb2.GetCoreWorkerStatsRequest()),
    }  # fmt: skip
    stub, method, request = calls[server]
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        try:
            getattr(stub(channel), method)(request, metadata=metadata, timeout=20)
        except grpc.RpcError as err:
            return err.code().name
    return "OK"


def _servers() -> tuple[dict[str, str], dict[str, str], object]:
    """The head's GCS, its raylet and the worker of a fresh actor (name -> host:port), the Ray
    auth variables that actor's worker has, and the actor (its worker lives while it is held)."""
    import ray

    class Echo:  # defined here, so pickled by value (the workers cannot import this module)
        def env(self) -> dict[str, str]:
            return {k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH")}

    actor = ray.remote(num_cpus=0)(Echo).remote()
    auth = ray.get(actor.env.remote(), timeout=120)
    node = ray.nodes()[0]
    where = ray._private.state.actors(actor._actor_id.hex())["Address"]
    return {"gcs": ray.get_runtime_context().gcs_address,
            "raylet": f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}",
            "worker": f"{where['IPAddress']}:{where['Port']}"}, auth, actor  # fmt: skip


def _other_process(code: str, *args: str, **auth: str) -> str:
    """`code` in another process whose only Ray auth variables are `auth`; its stdout and
    stderr. A refused `ray.init` gives up after 2 retries (20 by default)."""
    env = {k: v for k, v in os.environ.items() if k not in ray_auth.ENV}
    env |= {"PYTHONPATH": os.pathsep.join([str(REPO / "integration"),
                                          os.environ.get("PYTHONPATH", "")]),
            "RAY_NUM_REDIS_GET_RETRIES": "2", **auth}  # fmt: skip
    p = run_group([sys.executable, "-c", code, *args], env=env, timeout=180,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    return p.stdout + p.stderr


def _proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


@pytest.mark.slow  # 30-70 s on 2 busy cores: a Ray head and three processes joining it
def test_the_run_head_refuses_every_caller_without_the_runs_token(head, env, tmp_path):
    from onpolicy.grpo.procs import run_processes

    cluster = head()
    token_file = (tmp_path / "run" / ray_auth.TOKEN_FILE).resolve()
    # (b) a fresh token, in the run folder, only its owner may read it (0600 from creation).
    token = token_file.read_text()
    assert len(token) == 64 and token != DECOY
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600, oct(token_file.stat().st_mode)
    # Ray's default token file is neither written nor read.
    assert (env / ".ray" / "auth_token").read_text() == DECOY
    assert sorted(p.name for p in (env / ".ray").iterdir()) == ["auth_token"]
    want = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    # The head's processes and the actors' workers carry the run's token.
    servers, actor_auth, _actor = _servers()
    assert actor_auth == want
    names = {}
    for pid in run_processes(os.environ[RUN_ID_ENV]):
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        names[name] = {k: v for k, v in _proc_env(pid).items() if k.startswith("RAY_AUTH")}
    assert names.get("gcs_server") == want and names.get("raylet") == want, names

    # (a) every server refuses a call without the token, with a wrong one, with the decoy.
    for server, address in servers.items():
        got = {str(t)[:4]: _grpc(address, server, t) for t in (None, "0" * 64, DECOY, token)}
        assert got == {"None": "UNAUTHENTICATED", "0000": "UNAUTHENTICATED",
                       "dddd": "UNAUTHENTICATED", token[:4]: "OK"}, (server, got)  # fmt: skip
    ray_auth.check_enforced(servers["gcs"])
    gcs = servers["gcs"]
    # Another process: no auth variable at all; token mode with the decoy; with the run's token.
    none = _other_process(CLIENT, gcs)
    decoy = _other_process(CLIENT, gcs, RAY_AUTH_MODE="token")
    for out in (none, decoy):
        assert "JOINED" not in out, out[-3000:]
        assert "InvalidAuthToken: Authentication token is missing or incorrect" in out, out[-3000:]
    # A run joining this head as run.ray_address: let in, and the head passes its check.
    joined = _other_process(JOIN, str(TINY), gcs, str(tmp_path / "join"),
                            RAY_AUTH_TOKEN_PATH=str(token_file))  # fmt: skip
    assert f"JOINED {cluster.bundles + 1.0}" in joined, joined[-3000:]


@pytest.mark.slow  # 15-30 s: the same, on a head without auth
def test_with_auth_off_the_same_probes_are_let_in(head, env, tmp_path, monkeypatch):
    """The negative control: an inherited RAY_AUTH_MODE=disabled, accepted with
    run.ray_auth = false; every probe above gets in, and a joining run refuses the head."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    cluster = head(ray_auth=False)
    assert not (tmp_path / "run" / ray_auth.TOKEN_FILE).exists()
    servers, actor_auth, _actor = _servers()
    assert actor_auth == {"RAY_AUTH_MODE": "disabled"}
    for server, address in servers.items():
        got = {str(t)[:4]: _grpc(address, server, t) for t in (None, "0" * 64, DECOY)}
        assert got == {"None": "OK", "0000": "OK", "dddd": "OK"}, (server, got)
    with pytest.raises(ContractError, match=r"\[ray_auth\] .* accepts a call with a wrong token"):
        ray_auth.check_enforced(servers["gcs"])
    gcs = servers["gcs"]
    none = _other_process(CLIENT, gcs)
    decoy = _other_process(CLIENT, gcs, RAY_AUTH_MODE="token")
    cpus = f"JOINED {cluster.bundles + 1.0}"
    assert cpus in none and cpus in decoy, (none[-3000:], decoy[-3000:])
    joined = _other_process(JOIN, str(TINY), gcs, str(tmp_path / "join"), RAY_AUTH_TOKEN=DECOY)
    assert "REFUSED 2 [ray_auth]" in joined and "does not enforce token auth" in joined, joined


# --- (c) the rule, without Ray ------------------------------------------------------------------
def test_an_inherited_disabled_mode_is_refused_unless_ray_auth_is_false(
    env, tmp_path, monkeypatch, capsys
):
    _config(tmp_path)  # the same config loads with the variable unset
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ContractError) as err:
        _config(tmp_path)
    assert err.value.rule == "ray_auth" and "RAY_AUTH_MODE=disabled" in str(err.value)
    assert "run.ray_auth = false" in err.value.fix
    assert _config(tmp_path, ray_auth=False).run.ray_auth is False
    # The CLI exits 2 naming the rule, before anything is written.
    assert main(["--config", str(TINY), "--out", str(tmp_path / "out")]) == 2
    assert "[ray_auth] RAY_AUTH_MODE=disabled" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_cluster_checks_the_environment_again_when_it_starts(env, tmp_path, monkeypatch):
    """A variable set after the config was read is refused where Ray starts (exit 2)."""
    import ray

    c = Cluster(_config(tmp_path), run_id="x", authkey="0")
    monkeypatch.setenv("RAY_AUTH_MODE", "Disabled")
    with pytest.raises(RunError, match=r"\[ray_auth\] RAY_AUTH_MODE=disabled") as err:
        c._ray_init()
    assert err.value.code == 2 and not ray.is_initialized()


def test_joining_a_cluster_needs_a_token_only_its_owner_can_read(env, tmp_path, monkeypatch):
    join = {"ray_address": "127.0.0.1:6379"}
    with pytest.raises(ContractError, match=r"neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH"):
        _config(tmp_path, **join)
    token = tmp_path / "token"
    token.write_text("t" * 64)
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    with pytest.raises(ContractError, match=r"has mode 0644: other users can read the token"):
        _config(tmp_path, **join)
    token.chmod(0o600)
    assert _config(tmp_path, **join).run.ray_address == join["ray_address"]
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 64)
    _config(tmp_path, **join)
    with pytest.raises(ContractError, match=r"Ray Client address"):
        _config(tmp_path, ray_address="ray://127.0.0.1:10001")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    assert _config(tmp_path, ray_auth=False, **join).run.ray_auth is False
