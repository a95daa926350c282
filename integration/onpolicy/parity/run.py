"""`onpolicy parity`: SGLang samples, Megatron scores the same tokens, the log-probs must be equal.

For each layout pair (a rollout engine's TP/EP, a trainer's TP/PP/EP/ETP/SP) of a run config:
1. the model's HF checkpoint (the config's folder, or the seeded tiny model written once under
   the work folder);
2. one exact SGLang engine at the rollout layout samples the prompts with per-token log-probs
   (`onpolicy.parity.rollout_worker`, its own process); pairs with the same rollout and the
   same K segments (the pair's `contract.k_segments`, in both sides' ONPOLICY_K_SEGMENTS)
   share it;
3. Megatron at the training layout scores prompt + completion by forward_only
   (`onpolicy.parity.trainer_worker` under torchrun); pairs with the same training side (layout,
   spec and environment) share one job, which builds the model once and scores each of their
   rollouts;
4. each generated token's two fp32 log-probs are compared as bits (`onpolicy.compare`).
The table says, per pair, how many tokens are equal of how many compared; a mismatch names
the first differing token: sample, position, token id, both values and their bits in hex. A
rollout or trainer process that dies fails only the pairs that need it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import onpolicy
from onpolicy.compare import PairResult, compare, compare_rows
from onpolicy.contract import (
    ContractError,
    RunConfig,
    k_segments,
    load_config,
    model_checkpoint,
    resolve_plan,
    stock_env,
)
from onpolicy.layout import ParallelLayout
from onpolicy.rendezvous import run_group, torchrun
from onpolicy.rollout.engine import (
    NATIVE_OPS_ENV,
    RolloutRequest,
    engine_env,
    stock_runs_native_ops,
)
from onpolicy.segments import KSegments

INTEGRATION = Path(onpolicy.__file__).resolve().parents[1]
Digests = dict[int, torch.Tensor]
"""Sample index -> int64 whole-row digests of positions 0..len-2 (`train.logprobs`)."""


# --- layout pairs -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutLayout:
    """One SGLang engine's parallel degrees."""

    tp: int = 1
    """Ranks of the engine (SGLang tp_size)."""
    ep: int = 1
    """Expert parallel size inside the engine."""
    stock: bool = False
    """Sample on SGLang's stock path instead of the exact one: the negative control."""
    eager: bool = False
    """On CUDA, decode without CUDA graphs: the control of the graphs' replay."""

    @property
    def name(self) -> str:
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        flags = ("-stock" if self.stock else "") + ("-eager" if self.eager else "")
        return f"tp{self.tp}{ep}{flags}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pair:
    """A rollout layout and the trainer layout that must reproduce its log-probs."""

    rollout: RolloutLayout
    """The sampling engine's layout."""
    training: ParallelLayout
    """The scoring trainer's layout."""
    training_stock: bool = False
    """Score with Megatron's local spec instead of the exact one: the negative control."""

    @property
    def training_name(self) -> str:
        return self.training.name() + ("-stock" if self.training_stock else "")

    @property
    def name(self) -> str:
        return f"{self.rollout.name}:{self.training_name}"


_ROLLOUT_TOKEN = re.compile(r"^(tp|ep)(\d+)$|^(stock|eager)$")


def parse_pair(spec: str) -> Pair:
    """`ROLLOUT:TRAINING`, e.g. `tp2-ep2:world8-tp2-pp2-ep2-sp` or `tp1:tp2-sp`.

    Rollout tokens: tp<N>, ep<N>. Training: a `ParallelLayout` name (world<N>, default tp x
    pp; tp<N>, pp<N>, ep<N>, etp<N>, sp). Unnamed degrees are 1. `stock` on either side runs
    that engine's stock path instead of the exact one (a negative control: the pair must
    differ).
    """
    rollout, sep, training = spec.partition(":")
    if not sep or not rollout or not training:
        raise ContractError("parity_pairs", f"--pairs {spec!r} is not ROLLOUT:TRAINING",
                            "write e.g. tp2-ep2:world8-tp2-pp2-ep2-sp")  # fmt: skip

    def refuse(side: str, tok: str, allowed: str) -> ContractError:
        return ContractError(
            "parity_pairs",
            f"--pairs {spec!r}: {side} token {tok!r} is unknown or repeated",
            f"{side} tokens are {allowed} (<name><size>; sp, stock bare)",
        )

    r: dict[str, int] = {}
    for tok in rollout.split("-"):
        m = _ROLLOUT_TOKEN.match(tok)
        key = (m.group(1) or m.group(3)) if m else None
        if key is None or key in r:
            raise refuse("rollout", tok, "eager, ep, stock, tp")
        r[key] = int(m.group(2)) if m.group(2) else 1
    stock, eager = bool(r.pop("stock", 0)), bool(r.pop("eager", 0))
    tokens = training.split("-")
    training_stock = "stock" in tokens
    if tokens.count("stock") > 1:
        raise refuse("training", "stock", "the layout's and stock")
    try:
        layout = ParallelLayout.parse("-".join(t for t in tokens if t != "stock"))
    except ValueError as err:
        raise ContractError("parity_pairs", f"--pairs {spec!r}: training side: {err}",
                            "write e.g. tp2-ep2:world8-tp2-pp2-ep2-sp") from None  # fmt: skip
    return Pair(rollout=RolloutLayout(stock=stock, eager=eager, **r), training=layout,
                training_stock=training_stock)  # fmt: skip


def config_pair(cfg: RunConfig) -> Pair:
    """The pair a run config names: its rollout engine and its trainer."""
    return Pair(rollout=RolloutLayout(tp=cfg.rollout.tp, ep=cfg.rollout.ep), training=cfg.training)


def pair_overrides(pair: Pair) -> dict[str, object]:
    """Config overrides that put `pair` into a run config (engines fill the trainer's world
    when they can share its ranks, else the engine runs on its own)."""
    t, r = pair.training, pair.rollout
    engines = max(t.world // r.tp, 1)
    return {
        "training.world": t.world, "training.tp": t.tp, "training.pp": t.pp,
        "training.ep": t.ep, "training.etp": t.etp, "training.sp": t.sp, "training.dp": 0,
        "rollout.tp": r.tp, "rollout.ep": r.ep, "rollout.engines": engines,
        "rollout.colocate": engines * r.tp == t.world,
    }  # fmt: skip


def pair_config(path: str | os.PathLike, overrides: dict[str, object], pair: Pair) -> RunConfig:
    """The run config with `pair`'s layouts, checked against the contract (ContractError)."""
    cfg = load_config(path, {**overrides, **pair_overrides(pair)})
    try:
        resolve_plan(cfg)
    except ContractError as e:
        raise ContractError(e.rule, f"layout pair {pair.name}: {e.problem}", e.fix) from None
    return cfg


# --- running the two sides --------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A rollout or trainer process exited non-zero; the message carries the tail of its log."""


@dataclass(kw_only=True, slots=True)
class ParityRun:
    """Everything one `onpolicy parity` invocation needs besides the pairs."""

    config: str
    """The run config file."""
    overrides: dict[str, object] = field(default_factory=dict)
    """`--set` overrides, applied before each pair's layouts."""
    workdir: Path = Path("runs/parity")
    """Where the checkpoint, rollouts, scores and logs go."""
    prompts: int = 4
    """How many prompts each rollout samples."""
    new_tokens: int = 16
    """Tokens generated per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores at the same one)."""
    seed: int = 0
    """Seed of the prompts and of the sampling."""
    prompt_lengths: tuple[int, ...] | None = None
    """Each prompt's length (its count is the prompt count); None: `prompts` of 3 to 12."""
    row_digests: bool = False
    """Also compare every generated position's whole log-prob row, by digest (pairs with an
    exact rollout; a stock trainer digests `torch.log_softmax`'s rows, the rows' control)."""
    timeout: float = 900
    """Seconds a worker may run before it counts as dead."""


def make_prompts(cfg: RunConfig, n: int, seed: int,
                 lengths: tuple[int, ...] | None = None) -> list[list[int]]:  # fmt: skip
    """Prompts of ids below the end-of-sequence id: of `lengths`, or `n` of 3 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    high = cfg.shape.eos_token_id
    lengths = lengths or [3 + (5 * i + seed) % 10 for i in range(n)]
    return [torch.randint(0, high, (k,), generator=g).tolist() for k in lengths]


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(INTEGRATION), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}


def _run(what: str, cmd: list[str], env: dict, log: Path, timeout: float) -> None:
    with log.open("w") as f:
        try:  # a hung worker is killed with everything it started
            p = run_group(cmd, env=env, timeout=timeout, stdout=f, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            msg = f"{what} ran past {timeout:.0f} s and was killed; log: {log}"
            raise WorkerError(msg) from None
    if p.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise WorkerError(f"{what} exited {p.returncode}; log: {log}\n{tail}")


def rollout(run: ParityRun, cfg: RunConfig, ckpt: Path, layout: RolloutLayout,
            prompts: list[list[int]], folder: Path) -> list[dict]:  # fmt: skip
    """Sample every prompt on one engine at `layout` (exact, or stock for the control); the
    samples with their log-probs."""
    folder.mkdir(parents=True, exist_ok=True)
    req = RolloutRequest(prompts=prompts, new_tokens=run.new_tokens,
                         temperature=run.temperature, seed=run.seed)  # fmt: skip
    (folder / "request.json").write_text(json.dumps(asdict(req)))
    cmd = [sys.executable, "-m", "onpolicy.parity.rollout_worker", "--ckpt", str(ckpt),
           "--tp", str(layout.tp), "--ep", str(layout.ep), "--dtype", cfg.model.dtype,
           "--request", str(folder / "request.json"),
           "--out", str(folder / "samples.json")]  # fmt: skip
    cmd += ["--device", cfg.device] + (["--stock"] if layout.stock else [])
    native = layout.stock and stock_runs_native_ops(cfg.device)  # and decodes eagerly
    cmd += ["--eager"] if layout.eager or native else []
    if run.row_digests and not layout.stock:  # the sampler appends: a fresh folder per rollout
        shutil.rmtree(folder / "digests", ignore_errors=True)
        cmd += ["--row-digests", str(folder / "digests")]
    plan = resolve_plan(cfg)
    base = {**os.environ, **plan.rollout_env}
    base = stock_env(base) if layout.stock else base
    if native:
        base = {**base, **NATIVE_OPS_ENV}
    env = _env(engine_env(layout.tp, folder, cfg.device, base=base))
    _run(f"rollout engine {layout.name}", cmd, env, folder / "rollout.log", run.timeout)
    return json.loads((folder / "samples.json").read_text())["samples"]


Scores = tuple[dict[int, torch.Tensor], Digests | None]
"""Megatron's fp32 log-probs of one rollout's samples by sample index, and their row digests."""


def train_scores(run: ParityRun, cfg: RunConfig, ckpt: Path, pair: Pair,
                 rollouts: list[Path], folder: Path) -> dict[Path, Scores]:  # fmt: skip
    """One trainer job at the pair's training side scores the samples of every rollout folder in
    `rollouts` (the model is built once). Per rollout folder: Megatron's log-probs by sample
    index, and with `run.row_digests` each position's whole-row digest (None without; a stock
    rollout's are computed with its job's and left unused: the stock sampler records none)."""
    rows = run.row_digests
    folder.mkdir(parents=True, exist_ok=True)
    outs = {r: folder / r.name for r in rollouts}
    cmd = torchrun(pair.training.world, "-m", "onpolicy.parity.trainer_worker", "--ckpt",
                   str(ckpt), "--dtype", cfg.model.dtype, "--temperature", str(run.temperature),
                   "--device", cfg.device, *pair.training.cli_args())  # fmt: skip
    for r, out in outs.items():
        out.mkdir(exist_ok=True)
        (out / "scores.pt").unlink(missing_ok=True)
        (out / "digests.pt").unlink(missing_ok=True)
        cmd += ["--score", str(r / "samples.json"), str(out)]
    cmd += ["--stock"] if pair.training_stock else []
    cmd += ["--row-digests"] if rows else []
    env = _env(resolve_plan(cfg).training_env)
    _run(f"trainer {pair.training_name}", cmd, env, folder / "trainer.log", run.timeout)
    return {r: (torch.load(out / "scores.pt", weights_only=True),
                torch.load(out / "digests.pt", weights_only=True) if rows else None)
            for r, out in outs.items()}  # fmt: skip


def run_pairs(run: ParityRun, pairs: list[Pair], log=print) -> list[PairResult | WorkerError]:
    """Check every pair (contract first, all of them, before anything starts); run one rollout
    per distinct rollout layout and K segments (S depends on both sides' TPs), then one trainer
    job per distinct training side (layout, spec and environment) scoring every rollout its
    pairs name; compare. The results follow `pairs`. A rollout or trainer process that dies
    fails only the pairs that need it: their entry is its WorkerError, the others still run."""
    configs = {p: pair_config(run.config, run.overrides, p) for p in pairs}
    workdir = Path(run.workdir)
    first = configs[pairs[0]]
    ckpt = model_checkpoint(first, workdir)
    prompts = make_prompts(first, run.prompts, run.seed, run.prompt_lengths)

    def rollout_of(p: Pair) -> tuple[RolloutLayout, KSegments]:
        return p.rollout, k_segments(configs[p])

    rollouts: dict[tuple[RolloutLayout, KSegments], Path | WorkerError] = {}
    samples: dict[Path, list[dict]] = {}
    for p in pairs:
        key = rollout_of(p)
        if key in rollouts:
            continue
        s = key[1]
        folder = workdir / f"rollout-{p.rollout.name}-s{s.attention}-{s.experts}"
        log(f"parity: rollout {p.rollout.name} ({len(prompts)} prompts x {run.new_tokens} "
            f"tokens, T={run.temperature}, K segments {s.env_value()}) ...")  # fmt: skip
        try:
            samples[folder] = rollout(run, configs[p], ckpt, p.rollout, prompts, folder)
            rollouts[key] = folder
        except WorkerError as e:
            log(f"parity: rollout {p.rollout.name} failed: {e}")
            rollouts[key] = e

    # The training side's environment holds the K segments: pairs that agree on it share a job.
    jobs: dict[tuple[str, tuple], list[Pair]] = {}
    for p in pairs:
        if isinstance(rollouts[rollout_of(p)], Path):
            env = tuple(sorted(resolve_plan(configs[p]).training_env.items()))
            jobs.setdefault((p.training_name, env), []).append(p)
    scored: dict[Pair, Scores | WorkerError] = {}
    for members in jobs.values():
        p = members[0]
        folders = list(dict.fromkeys(rollouts[rollout_of(m)] for m in members))
        s = k_segments(configs[p])
        names = ", ".join(f.name.removeprefix("rollout-") for f in folders)
        log(f"parity: trainer {p.training_name} scores {names} ...")
        out = workdir / f"train-{p.training_name}-s{s.attention}-{s.experts}"
        try:
            found = train_scores(run, configs[p], ckpt, p, folders, out)
        except WorkerError as e:
            log(f"parity: trainer {p.training_name} failed: {e}")
            scored.update((m, e) for m in members)
            continue
        scored.update((m, found[rollouts[rollout_of(m)]]) for m in members)

    results: list[PairResult | WorkerError] = []
    for p in pairs:
        folder = rollouts[rollout_of(p)]
        got = folder if isinstance(folder, WorkerError) else scored[p]
        if isinstance(got, WorkerError):
            results.append(got)
            continue
        scores, digests = got
        result = compare(samples[folder], scores, p.name)
        if digests is not None and not p.rollout.stock:
            result = compare_rows(result, samples[folder], digests)
        rows = (
            f", rows {result.rows_equal} of {result.rows_compared}" if result.rows_compared else ""
        )
        log(f"parity: {p.name}: {result.equal} of {result.compared} equal{rows}")
        results.append(result)
    return results
