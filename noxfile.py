"""Sessions for the true-on-policy stack. All logic lives in integration/; these are thin.

nox -s tests                 build the patched engines (cached) and run the CPU test suite
nox -s tests -- -k patch     pass pytest arguments through
nox -s tests -- -m gpu       the GPU tests (on a CUDA host, after `nox -s build -- --gpu`)
nox -s build                 install torch CPU, patched megatron-core, patched sglang, onpolicy
nox -s build -- --gpu        the same with the CUDA dependency set (GPU hosts)
nox -s patches               apply both patch series into build/upstream/ and check them
nox -s lint                  pre-commit: ruff, ruff-format, patch check
nox -s bench                 CPU benchmarks: collectives, train step, rollout, weight sync, e2e
nox -s bench -- --gpu        the exact kernels vs cuBLAS/SDPA and the full-size check (CUDA host)
nox -s parity                SGLang samples, Megatron scores: log-probs bitwise per layout pair
nox -s convert -- ...        `onpolicy convert`: HF <-> Megatron torch-dist checkpoints, reshard
nox -s e2e                   the GRPO loop on configs/tiny-cpu.toml (`-- --config FILE ...`)
nox -s gpu-wheels            the offline GPU host's cp312 wheels, in parts (docs/gpu-host.md)
nox -s gpu-wheels -- --lean  and the one-call bundle of what the host lacks (build/gpu-lean/)
                             and the GRPO loop's parts (build/gpu-loop/)
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = "torch==2.13.0"
TORCH_CONSTRAINT = ROOT / "integration/onpolicy/upstream/torch-cpu.txt"
SGLANG_CPU_REQS = ROOT / "integration/onpolicy/upstream/sglang-cpu-requirements.txt"
TRITON = "triton==3.6.0"
"""The Triton of the GPU host's torch 2.11.0+cu130."""
TEST_REQS = [
    "pytest",
    "pytest-timeout",  # every test bounded (pyproject's timeout, modules' own budgets)
    "hypothesis",
    "numpy",
    "packaging>=24.2",
    "safetensors",
    "transformers",
    "ray",
    "psutil",  # megatron-core's dist-checkpoint writer (not a megatron-core dependency)
    "wandb",  # the GRPO run's metrics (offline unless WANDB_API_KEY is set)
    "tqdm",  # the GRPO run's progress bar
    TRITON,  # the CUDA backend's kernels, run by Triton's interpreter on CPU in CI
    "datasets",  # the dataset task's JSONL / Parquet files ([data])
    "pyarrow",  # datasets' Parquet reader and writer
    "math-verify",  # the "math" reward (HF's answer verifier)
]


def _tool(session: nox.Session, *args: str, silent: bool = False) -> str:
    """`python -m <args>` with integration/ importable (the patch tool needs nothing else)."""
    python = "python" if getattr(session.virtualenv, "location", None) else sys.executable
    out = session.run(python, "-m", *args, env={"PYTHONPATH": str(ROOT / "integration")},
                      silent=silent)  # fmt: skip
    return (out or "").strip().splitlines()[-1] if silent else ""


def _inputs_key(gpu: bool) -> str:
    """Hash of everything the engine install depends on: pins, patches, requirement files."""
    h = hashlib.sha256(b"gpu" if gpu else b"cpu")
    files = [ROOT / "pyproject.toml", ROOT / "noxfile.py", SGLANG_CPU_REQS, TORCH_CONSTRAINT]
    files += sorted((ROOT / "third_party").rglob("upstream.toml"))
    files += sorted((ROOT / "patches").rglob("*"))
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _install(session: nox.Session, gpu: bool = False) -> None:
    """Install the patched engines into the session venv; skipped when the inputs are unchanged.

    CPU: torch 2.13.0 (CPU build) is pinned by constraint for every install, sglang is
    installed without its CUDA-pinned dependency set, plus the light packages it needs on CPU.
    GPU (`--gpu`): no constraint; the patched sglang wheel brings its full upstream dependency
    set (CUDA torch, sglang-kernel, flashinfer), as upstream's install guide does.
    """
    stamp = Path(session.virtualenv.location) / f".onpolicy-engines-{_inputs_key(gpu)}"
    if stamp.exists():
        session.log(f"patched engines up to date ({stamp.name})")
        session.install("--no-deps", "-e", ".")
        return
    constraint = [] if gpu else ["-c", str(TORCH_CONSTRAINT)]
    session.install("--upgrade", "pip", "setuptools", "wheel")
    if not gpu:
        session.install(TORCH_CPU)
    _tool(session, "onpolicy.upstream", "apply")
    mcore = _tool(session, "onpolicy.upstream.install_tree", "megatron-lm", silent=True)
    sglang = _tool(session, "onpolicy.upstream.install_tree", "sglang", silent=True)
    session.install(*constraint, "--no-deps", mcore)
    if gpu:
        session.install("--force-reinstall", "--no-deps", sglang)
        session.install(sglang)
    else:
        session.install(*constraint, "-r", str(SGLANG_CPU_REQS))
        session.install(*constraint, "--no-deps", "--force-reinstall", sglang)
    session.install(*constraint, *TEST_REQS)
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
    _install(session, gpu="gpu" in session.posargs)  # `-- -m gpu`: the CUDA dependency set
    args = session.posargs or ["-m", "not gpu", "--durations=25"]  # CI's log: the 25 slowest
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    session.run("python", "-m", "pytest", *args, env=env)


@nox.session(python=False)
def patches(session: nox.Session) -> None:
    """Apply both series strictly into build/upstream/ and check them."""
    _tool(session, "onpolicy.upstream", "apply", *session.posargs)
    _tool(session, "onpolicy.upstream", "check", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """pre-commit: ruff, ruff-format and the patch-series check."""
    session.install("pre-commit")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")


@nox.session(python="3.11", default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (not timed tests), recorded in docs/benchmarks.md: bytes per rank of the exact
    collectives, the training-step time of the exact vs the local spec, the rollout tokens/s
    of the exact vs the stock engine, the time and bytes of a weight sync and the tiny GRPO
    run's wall time per phase, the Triton compile time of the GEMM's and attention's variants
    (for sm_90, on the CPU); with `-- --gpu`
    (a CUDA host) the exact kernels vs cuBLAS/SDPA/plain torch, the full-size prefill ==
    decode check and the exact vs the stock engine's rollout tokens/s on CUDA instead."""
    if "--gpu" in session.posargs:
        args = [a for a in session.posargs if a != "--gpu"]
        session.install("torch", "triton", "numpy", "safetensors")
        session.install("--no-deps", "-e", ".")
        out = ["--out", str(ROOT / "docs/benchmarks.md")]
        session.run("python", "-m", "onpolicy.bench.kernels", *out, *args)
        session.run("python", "-m", "onpolicy.bench.fullsize", "--native", *out)
        _install(session, gpu=True)  # the rollout bench runs the patched SGLang on CUDA
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        session.run("python", "-m", "onpolicy.bench.rollout_gpu", *out, env=env)
        return
    session.install(TORCH_CPU)
    session.install("-c", str(TORCH_CONSTRAINT), "numpy")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "onpolicy.bench.comm_bytes", *session.posargs,
                env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    session.install("-c", str(TORCH_CONSTRAINT), TRITON)  # compiles for sm_90 on the CPU
    session.run("python", "-m", "onpolicy.bench.compile", "--out", str(ROOT / "docs/benchmarks.md"))
    _install(session)  # the training-step benchmark runs the patched megatron-core
    session.run("python", "-m", "onpolicy.bench.train_step", "--out",
                str(ROOT / "docs/benchmarks.md"), env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    session.run("python", "-m", "onpolicy.bench.rollout", "--out", str(ROOT / "docs/benchmarks.md"))
    session.run("python", "-m", "onpolicy.bench.weight_sync", "--out",
                str(ROOT / "docs/benchmarks.md"))  # fmt: skip
    session.run("python", "-m", "onpolicy.bench.e2e", "--out", str(ROOT / "docs/benchmarks.md"),
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})  # fmt: skip


@nox.session(python="3.11", default=False)
def parity(session: nox.Session) -> None:
    """`onpolicy parity`: SGLang samples, Megatron scores the same tokens, bitwise per layout
    pair (`-- --config FILE --pairs ...`; default: configs/tiny-cpu.toml's own layouts)."""
    _install(session)
    args = session.posargs or ["--config", str(ROOT / "configs/tiny-cpu.toml")]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    session.run("onpolicy", "parity", *args, env=env)


@nox.session(python="3.11", default=False)
def convert(session: nox.Session) -> None:
    """`onpolicy convert`: HF <-> Megatron torch-dist checkpoints and resharding
    (`-- hf-to-dist|dist-to-hf|reshard ...`; `-- --help` lists them)."""
    _install(session)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    session.run("onpolicy", "convert", *(session.posargs or ["--help"]), env=env)


@nox.session(python="3.11", default=False)
def e2e(session: nox.Session) -> None:
    """`onpolicy e2e`: the GRPO loop, asserting train == rollout log-probs bit for bit at every
    step. Default: configs/tiny-cpu.toml on CPU. `-- --config FILE --set KEY=VALUE --steps N
    --out DIR --resume --bisect` pass through; `-- --gpu ...` installs the CUDA dependency set
    (GPU hosts, e.g. `-- --gpu --config configs/qwen3-30b-a3b-tp2pp2ep2-sp.toml`)."""
    gpu = "--gpu" in session.posargs
    args = [a for a in session.posargs if a != "--gpu"]
    _install(session, gpu=gpu)
    if "--config" not in args:
        args = ["--config", str(ROOT / "configs/tiny-cpu.toml"), *args]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    session.run("onpolicy", "e2e", *args, env=env)


@nox.session(name="gpu-wheels", python="3.11", default=False)
def gpu_wheels(session: nox.Session) -> None:
    """The offline GPU host's files (docs/gpu-host.md): gpu-host-requirements.txt's cp312 wheels
    and the pinned sglang cp312 wheel and megatron-core sdist, checked for unmet requirements,
    in build/wheels-cp312/part-NN/ folders of <= 60 MiB with a sha256 manifest; skipped when
    the requirements and pins are unchanged. `-- --cap-mib N` sets the part size. `-- --lean`
    then also builds build/gpu-lean/: one folder for one call (gpu-host-lean.txt's wheels, the
    patched engines as tarballs) and build/gpu-loop/ (Ray and torch-memory-saver, in parts)."""
    lean = "--lean" in session.posargs
    args = [a for a in session.posargs if a != "--lean"]
    session.install("pip", "packaging")  # pip download for another Python; marker evaluation
    _tool(session, "onpolicy.upstream.gpu_wheels", "download", "--out",
          str(ROOT / "build/wheels-cp312"), *args)  # fmt: skip
    if lean:
        _tool(session, "onpolicy.upstream.gpu_lean", "build", "--wheels",
              str(ROOT / "build/wheels-cp312"), "--out", str(ROOT / "build/gpu-lean"))  # fmt: skip
        _tool(session, "onpolicy.upstream.gpu_lean", "build-loop", "--wheels",
              str(ROOT / "build/wheels-cp312"), "--out", str(ROOT / "build/gpu-loop"))  # fmt: skip
