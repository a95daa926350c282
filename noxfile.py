"""Sessions for the true-on-policy stack. All logic lives in integration/; these are thin.

nox -s tests                 build the patched engines (cached) and run the CPU test suite
nox -s tests -- -k patch     pass pytest arguments through
nox -s tests -- -m gpu       the GPU tests (on a CUDA host, after `nox -s build -- --gpu`)
nox -s build                 install torch CPU, patched megatron-core, patched sglang, onpolicy
nox -s build -- --gpu        the same with the CUDA dependency set (GPU hosts)
nox -s patches               apply both patch series into build/upstream/ and check them
nox -s lint                  pre-commit: ruff, ruff-format, patch check
nox -s e2e                   the GRPO loop (not built yet; see README)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = "torch==2.13.0"
SGLANG_CPU_REQS = ROOT / "integration/onpolicy/upstream/sglang-cpu-requirements.txt"
SGLANG_GPU_REQS = ROOT / "integration/onpolicy/upstream/sglang-gpu-requirements.txt"
TEST_REQS = ["pytest", "hypothesis", "numpy", "packaging>=24.2", "safetensors", "transformers"]


def _tool(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "onpolicy.upstream", *args, env={"PYTHONPATH": "integration"})


def _inputs_key(gpu: bool) -> str:
    """Hash of everything the engine install depends on: pins, patches, requirement files."""
    h = hashlib.sha256(b"gpu" if gpu else b"cpu")
    files = [ROOT / "pyproject.toml", SGLANG_CPU_REQS, SGLANG_GPU_REQS]
    files += sorted((ROOT / "third_party").rglob("upstream.toml"))
    files += sorted((ROOT / "patches").rglob("*"))
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _install(session: nox.Session, gpu: bool = False) -> None:
    """Install the patched engines into the session venv; skipped when the inputs are unchanged."""
    stamp = Path(session.virtualenv.location) / f".onpolicy-engines-{_inputs_key(gpu)}"
    if stamp.exists():
        session.log(f"patched engines up to date ({stamp.name})")
        session.install("--no-deps", "-e", ".")
        return
    constraint = [] if gpu else ["-c", str(ROOT / "integration/onpolicy/upstream/torch-cpu.txt")]
    session.run_install("python", "-m", "pip", "install", "--upgrade", "pip", "setuptools", "wheel")
    if not gpu:
        session.install(TORCH_CPU)
    _tool(session, "apply")
    mcore = ROOT / "build/upstream/megatron-lm"
    session.install(*constraint, "--no-deps", "--no-build-isolation", str(mcore))
    reqs = SGLANG_GPU_REQS if gpu else SGLANG_CPU_REQS
    if reqs.exists():
        session.install(*constraint, "-r", str(reqs))
    wheel = session.run(
        "python", "-m", "onpolicy.upstream.install_tree", "sglang",
        env={"PYTHONPATH": "integration"}, silent=True,
    )  # fmt: skip
    session.install(*constraint, "--no-deps", "--force-reinstall", wheel.strip().splitlines()[-1])
    session.install(*constraint, *TEST_REQS, "ray", "nox")
    session.install(*constraint, "--no-deps", "-e", ".")
    for old in Path(session.virtualenv.location).glob(".onpolicy-engines-*"):
        old.unlink()
    stamp.write_text("ok\n")


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    """Install torch, patched megatron-core and sglang, and onpolicy (`-- --gpu` for CUDA)."""
    _install(session, gpu="--gpu" in session.posargs)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The CPU test suite on the real patched engines."""
    _install(session)
    args = session.posargs or ["-m", "not gpu"]
    session.run("python", "-m", "pytest", *args, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=False)
def patches(session: nox.Session) -> None:
    """Apply both series strictly into build/upstream/ and check them."""
    _tool(session, "apply", *session.posargs)
    _tool(session, "check", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """pre-commit: ruff, ruff-format and the patch-series check."""
    session.install("pre-commit")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")


@nox.session(python="3.11", default=False)
def e2e(session: nox.Session) -> None:
    """The tiny CPU GRPO run with exact-logprob assertions."""
    session.error(
        "nox -s e2e: the GRPO loop is not built yet (see README, 'Status'); "
        "run `nox -s tests` for what exists today"
    )
