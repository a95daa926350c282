"""Rewards of the dataset task: the `[reward]` table, the math rule, user functions by import
path, and the process pool they run in.

Every reward function has one signature:

    fn(prompt: str, response: str, label, metadata: dict) -> float | dict

`prompt` is the prompt's text as the model read it (after the chat template), `response` the
decoded response (cut at its stop token, special tokens skipped), `label` the row's label cell
and `metadata` the row's other columns. A float is the reward; a dict gives it as "score" and
any other numeric entries as extra metrics, logged per step as `reward/<key>` (their mean over
the step's samples).

`[reward] name`:
- "math" (`math_reward`): the response's final answer, the last complete `\\boxed{...}` or else
  the last number, checked against the label by HF's `math-verify`: 1.0 right, 0.0 wrong or no
  answer; it also reports `answered` (1.0 when a final answer was found);
- "custom": `path = "package.module:function"`, imported (and its signature checked) when the
  config is read;
- "band": the band task's own rule on token ids (`onpolicy.grpo.tasks.band`).

Rewards run in `RewardPool`: `workers` child processes (fresh interpreters, so nothing of the
driver's threads is inherited), one sample at a time each, with a per-sample timeout. A reward
that raises, returns something that is not a finite number (or a dict with one as "score"), or
runs past `timeout_s`, is a `RewardError` naming the sample and the function: the run stops
(exit 3). A failing reward is never scored 0.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

MATH = "onpolicy.grpo.rewards:math_reward"
"""The import path of the "math" reward."""
RESERVED = ("score", "mean", "std")
"""Keys a reward's dict cannot use for an extra metric (score is the reward itself; reward/mean
and reward/std are the loop's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    """How a response is scored (the `[reward]` table)."""

    name: str = ""
    """"math", "custom" or "band"; "" is the task's own: "band" for the band task, "math" for
    the dataset task."""
    path: str = ""
    """The "custom" reward: "package.module:function" (importable from the run's Python path)."""
    workers: int = 2
    """Processes scoring the responses (>= 1)."""
    timeout_s: float = 30.0
    """Seconds one response's reward may take; past it the run stops naming the sample."""


class RewardError(RuntimeError):
    """A reward function failed, returned a bad value or timed out on a sample."""


def _refuse(rule: str, problem: str, fix: str) -> Exception:
    """A ContractError, imported here: a pool process imports this module, and the contract
    package brings torch."""
    from onpolicy.contract.errors import ContractError

    return ContractError(rule, problem, fix)


# --- the math rule --------------------------------------------------------------------------
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")
"""A number: a sign, digits (thousands commas allowed), decimals, an optional /denominator."""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{` opened whose braces close (nested braces balanced; a box
    inside a box is the inner one); None when there is none."""
    found = None
    start = 0
    while True:
        i = text.find("\\boxed", start)
        if i < 0:
            return found
        j = i + len("\\boxed")
        while j < len(text) and text[j] == " ":
            j += 1
        start = i + 1
        if j >= len(text) or text[j] != "{":
            continue
        depth, k = 0, j
        while k < len(text):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    found = text[j + 1 : k]
                    break
            k += 1


def final_answer(response: str) -> str | None:
    """The response's final answer: the last complete `\\boxed{}`'s content; else, when the
    response has no `\\boxed` at all, its last number; else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    if "\\boxed" in response:  # an answer was boxed but never closed: malformed, not rescued
        return None
    numbers_ = _NUMBER.findall(response)
    if not numbers_:
        return None
    return re.sub(r"\s+", "", numbers_[-1]).replace(",", "")


def _parse(text: str) -> list:
    import logging

    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled", per call

    # math-verify's own timeouts use SIGALRM (main thread only) and score a timeout as wrong;
    # the pool's per-sample timeout is the one that counts, and it stops the run.
    for candidate in (f"${text}$", text):
        got = parse(candidate, parsing_timeout=None)
        if got:
            return got
    return []


def math_reward(prompt: str, response: str, label: Any, metadata: dict) -> dict:
    """1.0 when the response's final answer equals the label (math-verify), else 0.0."""
    answer = final_answer(response)
    if answer is None:
        return {"score": 0.0, "answered": 0.0}
    from math_verify import verify

    gold = _parse(str(label))
    if not gold:
        raise ValueError(f"math reward: the label {label!r} does not parse as math")
    pred = _parse(answer)
    right = bool(pred) and verify(gold, pred, timeout_seconds=None)
    return {"score": 1.0 if right else 0.0, "answered": 1.0}


# --- user functions by path -----------------------------------------------------------------
def reward_path(cfg: RewardConfig) -> str:
    """The import path of the config's reward function ("band" has none)."""
    return MATH if cfg.name == "math" else cfg.path


def load_reward(path: str) -> Any:
    """The function at "package.module:function", its signature checked; ContractError
    (rule reward_path or reward_signature) otherwise."""
    module, colon, attr = path.partition(":")
    if not colon or not module or not attr:
        raise _refuse(
            "reward_path",
            f"reward.path = {path!r} is not 'package.module:function'",
            "name the function as module:function",
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as err:  # ImportError, AttributeError, or the module failing as it loads
        raise _refuse(
            "reward_path",
            f"reward.path = {path!r} does not import: {type(err).__name__}: {err}",
            "make the module importable (PYTHONPATH) and the name right",
        ) from None
    check_signature(fn, path)
    return fn


def check_signature(fn: Any, path: str) -> None:
    """Refuse a reward that cannot be called as fn(prompt, response, label, metadata)."""
    want = "fn(prompt: str, response: str, label, metadata: dict) -> float | dict"
    if not callable(fn) or inspect.iscoroutinefunction(fn) or inspect.isclass(fn):
        raise _refuse(
            "reward_signature",
            f"reward.path = {path!r} is not a plain function",
            f"write it as {want}",
        )
    try:
        inspect.signature(fn).bind("prompt", "response", None, {})
    except TypeError as err:
        raise _refuse(
            "reward_signature",
            f"reward.path = {path!r} cannot be called with "
            f"(prompt, response, label, metadata): {err}",
            f"write it as {want}",
        ) from None
    except ValueError:  # no signature to read (a builtin): it is called and checked per sample
        pass


def check_value(value: Any) -> tuple[float, dict[str, float]]:
    """A reward's return value as (score, extra metrics); ValueError naming what is wrong."""

    def real(x: Any, what: str) -> float:
        if not isinstance(x, numbers.Real):
            raise ValueError(f"{what} is {x!r} ({type(x).__name__}), not a number")
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"{what} is {x!r}, not finite")
        return x

    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(value)})")
        extra = {}
        for k, v in value.items():
            if k == "score":
                continue
            if not isinstance(k, str) or not k or k in RESERVED or "/" in k:
                raise ValueError(
                    f"returned a dict with the key {k!r}; extra metric keys are "
                    f"non-empty strings without '/' other than {RESERVED}"
                )
            extra[k] = real(v, f"its {k!r}")
        return real(value["score"], "its 'score'"), extra
    return real(value, "the reward"), {}


# --- the pool -------------------------------------------------------------------------------
def _worker(conn: Any) -> None:
    """A pool process: import the function it is sent once, then score (index, args) until
    told to stop (or until the driver's end of the socket closes)."""
    try:
        fn = load_reward(conn.recv())
    except Exception as err:
        conn.send(("init", -1, f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", -1, None))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the driver is gone
            return
        if job is None:
            return
        index, args = job
        try:
            value = fn(*args)
            conn.send(("ok", index, check_value(value)))
        except BaseException as err:  # everything a user function raises is reported
            where = traceback.extract_tb(err.__traceback__)[-1]
            at = f"{where.filename}:{where.lineno} in {where.name}"
            text = f"{type(err).__name__}: {err} (at {at})"
            conn.send(("error", index, text))


class RewardPool:
    """`workers` processes scoring samples with the function at `path`, each within
    `timeout_s`; started on first use, stopped by `close`.

    Each is `python -m onpolicy.grpo.rewards FD`, a plain child process talking over a socket
    pair, with this process's Python path: not multiprocessing's spawn, which would re-import
    the driver's main module and leave its resource-tracker process running with the run's id
    until the driver exits."""

    def __init__(self, path: str, workers: int = 2, timeout_s: float = 30.0) -> None:
        self.path, self.workers, self.timeout_s = path, workers, timeout_s
        self._procs: list[tuple[Any, Any]] = []

    def start(self) -> None:
        if self._procs:
            return
        import os
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for _ in range(self.workers):
            mine, theirs = socket.socketpair()
            p = subprocess.Popen(
                [sys.executable, "-m", "onpolicy.grpo.rewards", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            theirs.close()
            conn = Connection(mine.detach())
            conn.send(self.path)
            self._procs.append((p, conn))
        for _, conn in self._procs:
            # Importing the function (and what it imports) may take a while; count it apart.
            try:
                started = conn.poll(max(self.timeout_s, 300.0))
                kind, _, info = conn.recv() if started else ("", -1, "no answer")
            except (EOFError, OSError) as err:
                kind, info = "", f"it exited ({type(err).__name__})"
            if kind != "ready":
                self.close()
                raise RewardError(f"reward {self.path}: a pool process could not load it: {info}")

    def score(self, jobs: list[tuple], names: list[str]) -> list[tuple[float, dict[str, float]]]:
        """Each job's (score, extra metrics), job i = the args (prompt, response, label,
        metadata) of the sample `names[i]` names; RewardError at the first failure."""
        from multiprocessing.connection import wait

        self.start()
        results: list[Any] = [None] * len(jobs)
        todo = deque(range(len(jobs)))
        idle = list(range(len(self._procs)))
        busy: dict[int, tuple[int, float]] = {}  # worker -> (job, started)
        while todo or busy:
            while todo and idle:
                w, j = idle.pop(), todo.popleft()
                self._procs[w][1].send((j, jobs[j]))
                busy[w] = (j, time.monotonic())
            oldest = min(t for _, t in busy.values())
            left = self.timeout_s - (time.monotonic() - oldest)
            conns = {self._procs[w][1]: w for w in busy}
            for conn in wait(list(conns), timeout=max(left, 0.0)):
                w = conns[conn]
                j, _ = busy.pop(w)
                try:
                    kind, index, value = conn.recv()
                except (EOFError, OSError):
                    code = self._kill(w)
                    raise RewardError(
                        f"reward {self.path} on {names[j]}: its process died (exit code {code})"
                    ) from None
                if kind == "error":
                    raise RewardError(f"reward {self.path} raised on {names[j]}: {value}")
                results[index] = value
                idle.append(w)
            now = time.monotonic()
            for w, (j, t) in list(busy.items()):
                if now - t > self.timeout_s:
                    self._kill(w)
                    raise RewardError(
                        f"reward {self.path} timed out on {names[j]} (over "
                        f"reward.timeout_s = {self.timeout_s} s)"
                    )
        return results

    def _kill(self, w: int) -> int | None:
        """Kill worker w (a stuck or broken one); its exit code."""
        p, conn = self._procs[w]
        if p.poll() is None:
            p.kill()
        try:
            p.wait(5)
        except Exception:  # subprocess.TimeoutExpired: left for close()
            pass
        conn.close()
        return p.returncode

    def close(self) -> None:
        """Stop every process (one that does not stop is killed)."""
        import subprocess

        for p, conn in self._procs:
            if p.poll() is None and not conn.closed:
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
        for p, conn in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if not conn.closed:
                conn.close()
        self._procs = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reward_metrics(extras: list[dict[str, float]]) -> dict[str, float]:
    """`reward/<key>`: each extra metric's mean over the samples that report it (math.fsum)."""
    keys = sorted({k for e in extras for k in e})
    return {
        f"reward/{k}": math.fsum(v) / len(v)
        for k in keys
        for v in [[e[k] for e in extras if k in e]]
    }


if __name__ == "__main__":  # a RewardPool process: python -m onpolicy.grpo.rewards FD
    import sys
    from multiprocessing.connection import Connection

    _worker(Connection(int(sys.argv[1])))
