"""`onpolicy parity` end to end: SGLang samples, Megatron scores, every log-prob equal in bits.

One CLI run on configs/tiny-cpu.toml covers the layout pairs (each rollout engine is started
once and scored by several trainer layouts):
- rollout TP2 EP2 against train TP2 PP2 EP2 SP (world 8);
- rollout TP2 (MoE TP 2) against train TP1;
- rollout TP1 against train TP2 SP;
- the negative controls, the same harness with one side on its engine's stock path: SGLang's
  stock CPU path sampling for the TP2 SP trainer, and Megatron's local spec scoring the TP2
  rollout at world 1; both must differ.
With `--row-digests` every generated position's whole log-prob row is compared too, by digest:
equal for every exact pair; the local spec's rows (torch's log_softmax) differ, and the stock
sampler records none.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.toml"
EXACT_PAIRS = ["tp2-ep2:world8-tp2-pp2-ep2-sp", "tp2:world1", "tp1:world2-tp2-sp"]
CONTROLS = ["tp1-stock:world2-tp2-sp", "tp2:world1-stock"]
PROMPTS, NEW_TOKENS, TEMPERATURE = 4, 12, 0.8
ROW = re.compile(r"^(\S+)\s+(\d+) / (\d+)\s+(\d+) / (\d+)\s+(bitwise equal|DIFFER)$")


def parity(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO / "integration"), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    cmd = [sys.executable, "-m", "onpolicy.cli", "parity", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def table(stdout: str) -> dict[str, tuple[int, int, str, int, int]]:
    """pair -> (tokens equal, compared, verdict, rows equal, rows compared)."""
    rows = {}
    for line in stdout.splitlines():
        if m := ROW.match(line):
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(6), int(m.group(4)),
                                int(m.group(5)))  # fmt: skip
    return rows


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_parity_pairs_and_stock_controls(tmp_path):
    p = parity("--config", str(CONFIG), "--pairs", *EXACT_PAIRS, *CONTROLS,
               "--workdir", str(tmp_path), "--prompts", str(PROMPTS),
               "--new-tokens", str(NEW_TOKENS), "--temperature", str(TEMPERATURE),
               "--row-digests")  # fmt: skip
    print(p.stdout)
    rows = table(p.stdout)
    assert set(rows) == {*EXACT_PAIRS, *CONTROLS}, f"rc {p.returncode}\n{p.stdout}\n{p.stderr}"
    tokens = PROMPTS * NEW_TOKENS
    for pair in EXACT_PAIRS:
        want = (tokens, tokens, "bitwise equal", tokens, tokens)
        assert rows[pair] == want, f"{pair}: {rows[pair]}\n{p.stdout}"
    # The same harness with one side on its stock path: it must break, and say where.
    for pair in CONTROLS:
        equal, compared, verdict, _, _ = rows[pair]
        assert compared == tokens and equal < compared and verdict == "DIFFER", rows[pair]
        head = f"{pair}: first mismatch"
        first = [line for line in p.stdout.splitlines() if line.startswith(head)]
        assert len(first) == 1 and re.search(
            r"token id \d+: rollout \S+ \(0x[0-9a-f]{8}\) vs trainer \S+ \(0x[0-9a-f]{8}\)$",
            first[0]), p.stdout  # fmt: skip
    assert rows["tp1-stock:world2-tp2-sp"][3:] == (0, 0)  # the stock sampler digests nothing
    rows_equal, rows_compared = rows["tp2:world1-stock"][3:]
    assert rows_compared == tokens and rows_equal < tokens, rows["tp2:world1-stock"]
    assert re.search(r"^tp2:world1-stock: first row mismatch: .* row digest 0x[0-9a-f]{16} vs "
                     r"trainer 0x[0-9a-f]{16}$", p.stdout, re.M), p.stdout  # fmt: skip
    assert p.returncode == 1, "a differing pair must fail the command"
