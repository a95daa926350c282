"""Token authentication of the run's Ray cluster (Ray 2.60).

With RAY_AUTH_MODE=token every gRPC server of a Ray cluster (the GCS, each raylet, each worker
and actor) refuses a call without the cluster's token (UNAUTHENTICATED), and every Ray process
presents the first token it finds: RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names,
else ~/.ray/auth_token. Each process reads these from its environment; the head's processes,
and the workers its raylet starts, inherit the environment of the process that starts the head.

Left to itself, `ray.init` of a new head turns token mode on with a token it writes to
~/.ray/auth_token, readable by every local user under the usual umask; an inherited
RAY_AUTH_MODE=disabled turns it off; and joining a cluster by address never turns it on. So
the run sets the mode and the token itself (`prepare`):
- a local head: a fresh token in the run folder (`TOKEN_FILE`, mode 0600 from its creation),
  named by RAY_AUTH_TOKEN_PATH; an inherited RAY_AUTH_TOKEN, which would win, is dropped, and
  ~/.ray/auth_token is neither written nor read;
- `run.ray_address`: the caller's token (RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH naming a file
  only its owner can read); after joining, the cluster's GCS must refuse a wrong token
  (`check_enforced`), or the run is refused;
- `run.ray_auth = false`: a local head with RAY_AUTH_MODE=disabled; a joined cluster as the
  environment says, unchecked.
An inherited RAY_AUTH_MODE=disabled with `run.ray_auth = true` is refused (`check_environment`).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from onpolicy.contract.errors import ContractError
from onpolicy.fsutil import write_atomic

RULE = "ray_auth"
"""The rule every refusal here names."""
TOKEN_FILE = "ray_auth_token"
"""The local head's token, in the run folder."""
ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""The variables Ray reads its mode and token from."""
_OFF = "set run.ray_auth = false only on a host where no other user can reach the Ray head"


def check_environment(ray_auth: bool, ray_address: str,
                      environ: Mapping[str, str] = os.environ) -> None:  # fmt: skip
    """ContractError [ray_auth] if `environ` would leave the run's Ray cluster without token
    authentication: RAY_AUTH_MODE=disabled, or joining `ray_address` with no token of the
    caller's (or one in a file other users can read). Nothing with `ray_auth` false."""
    if not ray_auth:
        return
    if environ.get("RAY_AUTH_MODE", "").strip().lower() == "disabled":
        raise ContractError(
            RULE,
            "RAY_AUTH_MODE=disabled in the environment turns off token authentication of the "
            "run's Ray cluster: any local user could run code as this user through it",
            f"unset RAY_AUTH_MODE, or {_OFF}",
        )
    if not ray_address:
        return
    fix = ("give the cluster's token in RAY_AUTH_TOKEN, or in a file of mode 0600 named by "
           f"RAY_AUTH_TOKEN_PATH; or {_OFF}")  # fmt: skip
    if ray_address.startswith("ray://"):
        raise ContractError(RULE, f"run.ray_address = {ray_address!r} is a Ray Client address, "
                            "whose token check the run cannot verify",
                            f"give the cluster's GCS address (host:port); or {_OFF}")  # fmt: skip
    if environ.get("RAY_AUTH_TOKEN"):
        return
    path = environ.get("RAY_AUTH_TOKEN_PATH", "")
    if not path:
        raise ContractError(RULE, f"run.ray_address = {ray_address!r} joins a Ray cluster "
                            "with no token: neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is "
                            "set", fix)  # fmt: skip
    try:
        st = os.stat(path)
    except OSError as err:
        raise ContractError(RULE, f"RAY_AUTH_TOKEN_PATH = {path!r}: {err.strerror}", fix) from None
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        raise ContractError(RULE, f"RAY_AUTH_TOKEN_PATH = {path!r} is not a file holding a "
                            "token", fix)  # fmt: skip
    if st.st_mode & 0o077:
        raise ContractError(RULE, f"RAY_AUTH_TOKEN_PATH = {path!r} has mode "
                            f"{stat.S_IMODE(st.st_mode):04o}: other users can read the token",
                            f"chmod 600 {path}")  # fmt: skip


def prepare(ray_auth: bool, ray_address: str, out_dir: Path) -> dict[str, str | None]:
    """Set this process's Ray mode and token for the run, before `ray.init` (see the module
    doc); the values of `ENV` it replaced, for `restore`."""
    saved = {k: os.environ.get(k) for k in ENV}
    if ray_address:
        if ray_auth:
            os.environ["RAY_AUTH_MODE"] = "token"
    elif ray_auth:
        path = Path(out_dir).resolve() / TOKEN_FILE
        write_atomic(path, secrets.token_hex(32), mode=0o600)
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    else:
        os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray's C++ side caches the mode (RayConfig) and the token it loaded: re-read both (a
    # process that ran another head before holds that head's).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return saved


def restore(saved: Mapping[str, str | None]) -> None:
    """Put back the variables `prepare` replaced (after `ray.shutdown`)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def check_enforced(gcs_address: str, timeout_s: float = 10.0) -> None:
    """ContractError [ray_auth] unless the GCS at `gcs_address` refuses a call that carries a
    wrong token (UNAUTHENTICATED): a cluster that accepts it checks no token."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    wrong = (("authorization", f"Bearer {secrets.token_hex(32)}"),)
    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), metadata=wrong,
                              timeout=timeout_s)  # fmt: skip
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return
            raise ContractError(RULE, f"could not check the token authentication of the Ray "
                                f"cluster at {gcs_address}: {err.code().name}",
                                _OFF) from None  # fmt: skip
    raise ContractError(RULE, f"the Ray cluster at {gcs_address} accepts a call with a wrong "
                        "token: it does not enforce token authentication",
                        f"start it with RAY_AUTH_MODE=token; or {_OFF}")  # fmt: skip
