"""`onpolicy e2e`: the GRPO run of a config, its metrics, its final table and its exit code.

    onpolicy e2e --config FILE [--set section.key=value ...] [--steps N] [--out DIR]
                 [--resume] [--bisect]

Exit codes: 0 every step ran (in true-on-policy mode: abs_diff and kl 0.0 at every step);
1 a step broke the true-on-policy assertion; 2 a refused config or resume; 3 an actor died,
failed or hung, the system failed the driver (an OSError: a full disk, a missing file), or a
process of the run had to be killed at teardown; 130 interrupted.

The run directory (run.out, default runs/<config name>):

    config.json          the resolved config (every table, defaults filled in)
    metrics.jsonl        one JSON object per step ({"step": N, metric: value, ...})
    tiny-seed*/          the seeded tiny HF checkpoint the run starts from (tiny configs)
    checkpoints/         torch-dist saves every run.checkpoint_every steps (iter_N, latest)
    violation.json       the first differing token of a step that broke the assertion
    bisect/              per-layer captures of both engines (--bisect)
    actors.json          each actor's process id, by name ("trainer rank 3", "engine0")
    ray_auth_token       the run's Ray token (0600; its local head takes no call without it)
    times.json           setup, Ray start, slowest trainer setup, teardown and wall seconds
    wandb/               the wandb run (offline unless WANDB_API_KEY is set)

SGLang's and inductor's compile caches go to run.cache_dir (shared by runs).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from onpolicy.bits import hex_bits
from onpolicy.fsutil import write_atomic
from onpolicy.grpo.cluster import RunError
from onpolicy.grpo.driver import Driver, OnPolicyViolation
from onpolicy.grpo.memory import gpu_memory_used

TABLE = [("step", "step", "{}"), ("abs_diff", "train/train_rollout_logprob_abs_diff", "{!r}"),
         ("kl", "train/train_rollout_kl", "{!r}"), ("equal", "train/logprob_equal_frac", "{:.4f}"),
         ("routing", "train/routing_mismatch", "{!r}"), ("reward", "reward/mean", "{:.3f}"),
         ("grad_norm", "grad_norm", "{:.4g}"), ("version", "weight_version", "{}"),
         ("rollout_s", "time/rollout_s", "{:.2f}"), ("train_s", "time/train_s", "{:.2f}"),
         ("sync_s", "time/sync_s", "{:.2f}")]  # fmt: skip
"""The final table's columns: heading, metric, format."""
EVAL_TABLE = [("eval", "eval/reward_mean", "{:.3f}"), ("pass@k", "eval/pass@k", "{:.3f}")]
"""Columns shown when some step evaluated (`[eval]`), after the reward column."""


def format_table(rows: list[dict]) -> str:
    """The final table: one row per step, a column per TABLE entry ("-" where a metric is
    missing, e.g. the training columns of a step that stopped at the assertion)."""
    cols = []
    table = list(TABLE)
    if any(key in r for r in rows for _, key, _ in EVAL_TABLE):
        at = [key for _, key, _ in table].index("reward/mean") + 1
        table[at:at] = EVAL_TABLE
    for head, key, fmt in table:
        cells = [fmt.format(r[key]) if key in r else "-" for r in rows]
        width = max(len(head), *(len(c) for c in cells))
        cols.append([head.rjust(width)] + [c.rjust(width) for c in cells])
    return "\n".join("  ".join(line) for line in zip(*cols, strict=True))


def _violation_record(v: OnPolicyViolation) -> dict:
    m = v.mismatch
    rec = {"step": v.step, "message": str(v), "metrics": v.metrics}
    if m is not None:
        s = v.samples[m.sample]
        rec["first_mismatch"] = {
            "sample": m.sample, "position": m.position, "completion_index": m.completion_index,
            "token": m.token, "rollout": float(m.rollout), "rollout_hex": hex_bits(m.rollout),
            "trainer": float(m.trainer), "trainer_hex": hex_bits(m.trainer),
            "prompt": s["prompt"], "output_ids": s["output_ids"], "seed": s["seed"],
            "engine": s["engine"],
        }  # fmt: skip
    return rec


def run(e, *, steps: int | None = None, resume: bool = False, bisect: bool = False,
        console=None, run_id: str | None = None) -> int:  # fmt: skip
    """Run the config's GRPO loop; the exit code (see the module doc). `console` (default: the
    sys.stderr of the moment, not of import time) gets the run's messages."""
    from onpolicy.grpo.metrics import MetricsLogger, resolve_wandb_mode

    console = console if console is not None else sys.stderr

    def say(msg: str) -> None:
        print(msg, file=console, flush=True)

    total = steps if steps is not None else e.grpo.steps
    try:  # before anything starts: a wandb mode this Python cannot serve is refused here
        resolve_wandb_mode(e.run.wandb_mode)
    except ValueError as err:
        say(f"onpolicy e2e: {err}")
        return 2
    before = None
    if e.cfg.device == "cuda":  # teardown must give back what the run took, not all of it
        try:
            before = gpu_memory_used()
        except RuntimeError as err:
            say(f"onpolicy e2e: GPU memory before the run not known: {err}")
    driver = Driver(e, resume=resume, last_step=total, log=say, run_id=run_id)
    logger, rows, code, graceful = None, [], 0, True
    t0 = time.perf_counter()
    try:
        say(f"onpolicy e2e: {e.cfg.name or e.source}: {total} steps, out {driver.out}")
        driver.setup()
        tm = driver.times
        say(f"onpolicy e2e: {len(driver.trainers)} trainer ranks and {len(driver.engines)} "
            f"engines up in {tm['setup_s']:.1f} s (Ray {tm['ray_init_s']:.1f} s, slowest trainer "
            f"rank {tm['trainer_setup_s']:.1f} s)" +
            (f"; resumed at step {driver.start_step}" if driver.start_step else ""))  # fmt: skip
        if (w := driver.cluster.warmup) is not None:
            say(f"onpolicy e2e: trainer compile warm-up: {w['batches']} batches in "
                f"{w['seconds']:.1f} s, {w['compiles']} Triton compiles "
                f"({w['compile_seconds']:.1f} s), {w['cache_hits']} from disk")  # fmt: skip
        logger = MetricsLogger(driver.out, run_name=e.cfg.name or "onpolicy", config=e.to_dict(),
                               total_steps=total, start_step=driver.start_step,
                               wandb_project=e.run.wandb_project, wandb_mode=e.run.wandb_mode,
                               console=console, progress=e.run.progress)  # fmt: skip
        for step in range(driver.start_step + 1, total + 1):
            rec = driver.step(step)
            logger.log(step, rec.metrics)
            rows.append({"step": step, **rec.metrics})
            driver.checkpoint_step(step)
    except OnPolicyViolation as v:
        code = 1
        if logger is not None:
            logger.log(v.step, v.metrics)
        rows.append({"step": v.step, **v.metrics})
        _write(driver.out / "violation.json", _violation_record(v))
        say(f"onpolicy e2e: {v}")
        if bisect and v.mismatch is not None:
            try:
                say(driver.bisect(v))
            except (RunError, ValueError) as err:
                say(f"bisect: could not rerun the sample: {err}")
    except RunError as err:
        code, graceful = err.code, False
        say(f"onpolicy e2e: {err}")
    except OSError as err:  # the system, not the run's logic: one line, not a traceback
        code, graceful = 3, False
        say(f"onpolicy e2e: {type(err).__name__}: {err}")
    except KeyboardInterrupt:
        code, graceful = 130, False
        say("onpolicy e2e: interrupted; tearing down")
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # teardown is not interrupted
        try:
            if logger is not None:
                logger.close()
            left = driver.teardown(graceful)
        finally:
            signal.signal(signal.SIGINT, previous)
        if left:
            say("onpolicy e2e: killed processes of the run left after teardown: " + "; ".join(left))
            code = code or 3
    if e.cfg.device == "cuda":
        try:
            used, waited = memory_after_teardown(before)
        except RuntimeError as err:  # nvidia-smi missing, failed or hung: the check is lost
            say(f"onpolicy e2e: GPU memory after teardown not known: {err}")
            code = code or 3
        else:
            problem = memory_left(before, used)
            say(f"onpolicy e2e: GPU memory after teardown (MiB): {used}, {waited:.1f} s after "
                f"it; before the run: {before if before is not None else 'not known'}" +
                (f"; {problem}" if problem else ""))  # fmt: skip
            if problem:
                code = code or 3
    wall = time.perf_counter() - t0
    if driver.owns_out:  # a run refused at its folder writes nothing there
        _write(driver.out / "times.json", {**driver.times, "wall_s": wall, "exit": code})
    driver.release()
    if rows:
        say(format_table(rows))
    if "teardown_s" in driver.times:
        say(f"onpolicy e2e: teardown {driver.times['teardown_s']:.1f} s")
    say(f"onpolicy e2e: {'done' if code == 0 else f'stopped (exit {code})'} in {wall:.1f} s")
    return code


def memory_left(before: list[int] | None, after: list[int]) -> str:
    """What the run left on the GPUs: "" when every GPU uses no more than before the run, else
    the rule and the GPUs above it. Without a reading from before (nvidia-smi failed then),
    the run must leave them at 0 MiB. Another process on a shared GPU may have taken memory
    meanwhile; the message names the numbers so that can be told apart."""
    known = before is not None and len(before) == len(after)
    base = before if known else [0] * len(after)
    over = [(i, a, b) for i, (a, b) in enumerate(zip(after, base, strict=True)) if a > b]
    if not over:
        return ""
    rule = "above its use before the run" if known else "not back to 0 MiB"
    return "[gpu_memory] GPU memory " + rule + ": " + ", ".join(
        f"GPU {i} {a} MiB (before {b})" for i, a, b in over)  # fmt: skip


SETTLE_S = 60.0
"""Seconds the GPUs' memory may take to come back after teardown. The driver gives a killed
process's memory back only once it has torn down its context, which can lag the process's
end by seconds (one that held 92 GB of GPU memory and a 43 GB checkpoint's host copies)."""


def memory_after_teardown(
    before: list[int] | None, *, settle_s: float = SETTLE_S, interval_s: float = 0.5,
    read: Callable[[], list[int]] = gpu_memory_used,
) -> tuple[list[int], float]:  # fmt: skip
    """The GPUs' memory in use (MiB) once `memory_left` finds nothing left, read again every
    `interval_s` for at most `settle_s`, and the seconds it took; past that, the last reading,
    which `memory_left` then names. RuntimeError from `read` (nvidia-smi) passes through."""
    t0 = time.monotonic()
    while True:
        used = read()
        waited = time.monotonic() - t0
        if not memory_left(before, used) or waited >= settle_s:
            return used, waited
        time.sleep(interval_s)


def _write(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="onpolicy e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", required=True, help="TOML run config, e.g. configs/tiny-cpu.toml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (TOML value), e.g. --set grpo.steps=4; wins "
                    "over the file")  # fmt: skip
    ap.add_argument("--steps", type=int, help="steps to run (default grpo.steps)")
    ap.add_argument("--out", help="run directory (default run.out, else runs/<config name>)")
    ap.add_argument("--address", help="a Ray cluster to join (default: start a local head)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the run directory's latest checkpoint")  # fmt: skip
    ap.add_argument("--bisect", action="store_true",
                    help="on a true-on-policy violation, rerun the sample on both engines with "
                    "per-layer captures and name the first layer and op that differ")  # fmt: skip
    ap.add_argument("--run-id", help="the id that marks every process of the run, for teardown "
                    "to find and for tools to watch (default: a fresh one)")  # fmt: skip
    args = ap.parse_args(argv)
    from onpolicy.contract import ContractError, parse_override
    from onpolicy.grpo.config import load_e2e_config

    try:
        overrides = dict(parse_override(item) for item in args.set)
        if args.out:
            overrides["run.out"] = args.out
        if args.address:
            overrides["run.ray_address"] = args.address
        if args.steps is not None:
            overrides["grpo.steps"] = args.steps
        e = load_e2e_config(args.config, overrides)
    except ContractError as err:
        print(f"onpolicy e2e: {args.config}: {err}", file=sys.stderr)
        return 2
    return run(e, resume=args.resume, bisect=args.bisect, run_id=args.run_id)
