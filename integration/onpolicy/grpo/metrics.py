"""The driver's metric sinks: a JSONL file, wandb, one console line per step, a progress bar.

Only the driver process writes metrics. One `MetricsLogger.log(step, metrics)` sends the metrics
to every sink.

JSONL (`out_dir/metrics.jsonl`):
- There is one object per step, `{"step": step, **metrics}`, in the order the steps were logged.
- Python floats round-trip bit for bit, because json writes the shortest repr.
- NaN and the infinities have no JSON literal. They are written as the strings "nan", "inf" and
  "-inf", so the file stays valid JSON. `read_metrics` turns those strings back into floats, so a
  str metric must not use one of them as its value.
- Each line is one `os.write` on an O_APPEND descriptor, followed by an fsync. A killed run
  leaves whole lines, except at worst a trailing fragment with no newline. `read_metrics` and
  the resume both drop such a fragment.
- Resume from `start_step` (the last step whose results the checkpoint holds): lines with
  step > start_step are dropped. The file is rewritten atomically (temp file, fsync,
  os.replace), so the resumed run's file equals an uninterrupted run's. A fresh run
  (start_step 0) starts from an empty file.

wandb:
- Mode "auto" is "online" when WANDB_API_KEY is set, else "offline". "online", "offline" and
  "disabled" force the mode, and "disabled" never imports wandb.
- The run id is a hash of the run name, the resolved out_dir and a random component a fresh
  run draws and keeps in the folder (`.wandb-run`). A resumed run reads it back and continues
  the same wandb run (resume="allow"); a fresh run never logs into an older one.
- Only numeric values are logged, with the step as wandb's step. wandb itself ignores a step
  below one it already holds, for example when a run died after logging a step that its last
  checkpoint did not reach.

Console: `format_line` gives one line per step, from the metric names below. A field
whose metric is missing or None is left out. The progress bar (tqdm) is drawn only when
`progress` is set and the console is a TTY, so logs and captured test output get only the
lines.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import secrets
import sys
from pathlib import Path
from typing import IO, Any

from onpolicy.fsutil import write_atomic

Metrics = dict[str, float | int | str | None]

ABS_DIFF = "train/train_rollout_logprob_abs_diff"
"""Mean |trainer log-prob - rollout log-prob| over response tokens (0 under the contract)."""
KL = "train/train_rollout_kl"
"""KL(rollout || trainer) estimate over response tokens (0 under the contract)."""
REWARD_MEAN = "reward/mean"
"""Mean reward of the step's samples."""
REWARD_STD = "reward/std"
"""Std of the rewards of the step's samples."""
RESPONSE_LEN = "response/length_mean"
"""Mean response length in tokens."""
EVAL_REWARD = "eval/reward_mean"
"""Mean reward of the eval samples (steps that evaluate)."""
EVAL_PASS = "eval/pass@k"
"""Share of eval prompts with a passing sample among their k."""
GRAD_NORM = "grad_norm"
"""Gradient norm before clipping."""
WEIGHT_VERSION = "weight_version"
"""Weight version the step's rollout was generated with."""
TIME_ROLLOUT = "time/rollout_s"
"""Seconds spent generating."""
TIME_SCORE = "time/score_s"
"""Seconds spent in the trainer's log-probs of the rollout."""
SCORE_COMPILES = "compile/score_kernels"
"""Triton kernels trainer rank 0 compiled or loaded from disk while scoring (CUDA only): 0 once
the warm-up before step 1 has covered the step's batch."""
TRAIN_COMPILES = "compile/train_kernels"
"""Triton kernels trainer rank 0 compiled or loaded from disk during the update (CUDA only): 0
once the warm-up before step 1 has covered the step's micro-batches."""
TIME_TRAIN = "time/train_s"
"""Seconds spent in the update."""
TIME_SYNC = "time/sync_s"
"""Seconds spent syncing weights to the engines."""

NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
"""How the JSONL spells NaN and the infinities, which JSON has no literal for."""

WANDB_MODES = ("auto", "online", "offline", "disabled")


def _num(x: float | int) -> str:
    """Short, but a non-zero value never prints as zero (abs_diff 1e-9 must show)."""
    if isinstance(x, bool) or isinstance(x, numbers.Integral):
        return str(int(x))
    x = float(x)
    return "0.0" if x == 0.0 else f"{x:.4g}"


def format_line(step: int, total: int, metrics: Metrics) -> str:
    """`step 3/10 | abs_diff 0.0 | kl 0.0 | reward 0.41±0.12 | ... | rollout 4.1s train 2.0s`."""
    m = {k: v for k, v in metrics.items() if v is not None}
    parts = [f"step {step}/{total}"]
    for label, key in (("abs_diff", ABS_DIFF), ("kl", KL)):
        if key in m:
            parts.append(f"{label} {_num(m[key])}")
    if REWARD_MEAN in m:
        std = f"±{float(m[REWARD_STD]):.2f}" if REWARD_STD in m else ""
        parts.append(f"reward {float(m[REWARD_MEAN]):.2f}{std}")
    if RESPONSE_LEN in m:
        parts.append(f"len {float(m[RESPONSE_LEN]):.1f}")
    if EVAL_REWARD in m:
        parts.append(f"eval {float(m[EVAL_REWARD]):.2f} pass@k {float(m[EVAL_PASS]):.2f}")
    if GRAD_NORM in m:
        parts.append(f"grad_norm {_num(m[GRAD_NORM])}")
    if WEIGHT_VERSION in m:
        parts.append(f"v{m[WEIGHT_VERSION]}")
    phases = (("rollout", TIME_ROLLOUT), ("score", TIME_SCORE), ("train", TIME_TRAIN),
              ("sync", TIME_SYNC))  # fmt: skip
    times = [f"{label} {float(m[key]):.1f}s" for label, key in phases if key in m]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)


def _encode(key: str, value: Any) -> float | int | str | None:
    """A JSON-ready value: bools and other integers to int, reals to float, non-finite to str."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isfinite(x):
            return x
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    raise TypeError(f"metrics: {key!r} must be a float, int, str or None, got "
                    f"{type(value).__name__}")  # fmt: skip


def encode_line(step: int, metrics: Metrics) -> str:
    """One JSONL line, newline included."""
    if "step" in metrics:
        raise ValueError("metrics: 'step' is the line's own key; pass the step as log's argument")
    record = {"step": int(step), **{k: _encode(k, v) for k, v in metrics.items()}}
    return json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n"


def decode_line(line: str) -> dict:
    """One JSONL line back to a dict; the non-finite strings become floats again."""
    record = json.loads(line)
    return {k: NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def _whole_lines(path: Path) -> list[str]:
    """The file's newline-terminated lines; a trailing fragment (a killed write) is dropped."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1] if line.strip()]


def _records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) for each whole line; a line that is not JSON is refused with its number."""
    out = []
    for n, line in enumerate(_whole_lines(path), start=1):
        try:
            out.append((line, decode_line(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON metrics line ({e}): {line[:80]!r}") from e
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics JSONL file, in file order, with non-finite floats restored."""
    return [record for _, record in _records(Path(path))]


def truncate_metrics(path: Path, start_step: int) -> int:
    """Keep the lines with step <= start_step (atomically); return the last kept step or 0."""
    kept = [(line, r) for line, r in _records(path) if r["step"] <= start_step]
    write_atomic(path, "".join(line for line, _ in kept), mode=0o600)  # 0600 as it always was
    return kept[-1][1]["step"] if kept else 0


def resolve_wandb_mode(mode: str, environ: dict[str, str] | None = None) -> str:
    """Mode "auto" -> "online" with WANDB_API_KEY set, else "offline", and "disabled" where
    wandb is not installed (metrics.jsonl is the record); others pass through, and "online" or
    "offline" without wandb is refused."""
    import importlib.util

    if mode not in WANDB_MODES:
        raise ValueError(f"metrics: wandb_mode must be one of {WANDB_MODES}, got {mode!r}")
    installed = importlib.util.find_spec("wandb") is not None
    if mode != "auto":
        if mode != "disabled" and not installed:
            raise ValueError(
                f"metrics: wandb_mode = {mode!r} needs wandb, which this Python "
                "cannot import; install it, or set run.wandb_mode = 'disabled'"
            )
        return mode
    if not installed:
        return "disabled"
    env = os.environ if environ is None else environ
    return "online" if env.get("WANDB_API_KEY") else "offline"


WANDB_NONCE = ".wandb-run"
"""The file in the run folder holding the run's fresh wandb id component."""


def wandb_run_id(run_name: str, out_dir: Path, nonce: str) -> str:
    """The wandb id of the run named `run_name` in `out_dir` whose fresh component is `nonce`."""
    key = f"{run_name}\0{Path(out_dir).resolve()}\0{nonce}".encode()
    return hashlib.sha256(key).hexdigest()[:16]


def run_nonce(out_dir: Path, fresh: bool) -> str:
    """A fresh run's new random id component, kept in the folder; a resumed run reads it back
    (so it continues its own wandb run, and a new run in a folder of the same name never
    logs into an old one)."""
    path = Path(out_dir) / WANDB_NONCE
    if not fresh and path.is_file():
        return path.read_text().strip()
    nonce = secrets.token_hex(8)
    write_atomic(path, nonce + "\n")
    return nonce


class MetricsLogger:
    """Sends each step's metrics to the JSONL file, wandb, the console and the progress bar."""

    def __init__(self, out_dir: Path, *, run_name: str, config: dict, total_steps: int,
                 start_step: int = 0, wandb_project: str = "onpolicy", wandb_mode: str = "auto",
                 console: IO[str] = sys.stderr, progress: bool = True) -> None:  # fmt: skip
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"metrics: start_step ({start_step}) must be in [0, total_steps "
                             f"({total_steps})]")  # fmt: skip
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.total_steps = total_steps
        self.console = console
        self.wandb_mode = resolve_wandb_mode(wandb_mode)
        self._closed = False
        self._last_step = truncate_metrics(self.path, start_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._run = None
        self._bar = None
        try:
            if self.wandb_mode != "disabled":
                import wandb

                run_id = wandb_run_id(
                    run_name, self.out_dir, run_nonce(self.out_dir, fresh=start_step == 0)
                )
                self._run = wandb.init(
                    project=wandb_project, name=run_name, dir=str(self.out_dir), config=config,
                    mode=self.wandb_mode, resume="allow", id=run_id,
                    # The driver prints its own lines; wandb must not capture or echo the console.
                    settings=wandb.Settings(console="off", silent=True),
                )  # fmt: skip
            if progress and getattr(console, "isatty", lambda: False)():
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, initial=start_step, file=console,
                                 desc=run_name, unit="step", dynamic_ncols=True)  # fmt: skip
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Metrics) -> None:
        """Write one step's metrics to every sink; steps must increase."""
        if self._closed:
            raise RuntimeError("metrics: log() after close()")
        if step <= self._last_step:
            raise ValueError(f"metrics: step {step} is not after the last logged step "
                             f"{self._last_step}")  # fmt: skip
        data = encode_line(step, metrics).encode("utf-8")
        # One write on an O_APPEND descriptor: a crash leaves whole lines or a trailing fragment.
        written = os.write(self._fd, data)
        while written < len(data):
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)
        self._last_step = step

        if self._run is not None:
            numeric = {k: (int(v) if isinstance(v, bool) else v) for k, v in metrics.items()
                       if isinstance(v, numbers.Real)}  # fmt: skip
            # commit: the row goes out now, not when the next step begins (a killed run keeps it).
            self._run.log(numeric, step=step, commit=True)

        line = format_line(step, self.total_steps, metrics)
        if self._bar is not None:
            self._bar.write(line, file=self.console)
            self._bar.update(step - self._bar.n)
        else:
            print(line, file=self.console, flush=True)

    def close(self) -> None:
        """Close every sink; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._run is not None:
            import wandb

            self._run.finish()
            wandb.teardown()  # stops wandb's service process, which would outlive the run
        os.close(self._fd)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
