"""SGLang on CUDA, TP1, the exact path with decode CUDA graphs, chunked prefill and the radix
cache on, against Megatron at world 1 on the same tokens from the same checkpoint:
`onpolicy parity` with configs/one-gpu.toml (Qwen3-30B-A3B's layer dims, 4 layers, seeded).

16 co-batched prompts of 1 to 2049 tokens, 32 new tokens each (512 compared per rollout):
- at T = 1.0 and 0.7 every generated token's log-prob equals the trainer's in its bits;
- at T = 0.7 the same engine without graphs (eager decode) gives the same tokens and bits, so a
  replay is the eager step;
- every compared position's whole log-prob row (all 151936 entries) has the same digest on
  both sides (`rollout.digests`, `train.logprobs(digests=True)`);
- the negative controls: SGLang's stock CUDA path (triton attention, its own ops) against the
  same trainer reports mismatches and names the first in hex; the exact rollout's rows against
  Megatron's local spec (torch's log_softmax rows) differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from onpolicy.bits import n_differ
from onpolicy.parity import ParityRun, WorkerError, parse_pair, run_pairs

pytestmark = pytest.mark.gpu
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "one-gpu.toml"
LENGTHS = (1, 2049, 300, 17, 1024, 5, 64, 2, 700, 33, 128, 9, 1500, 3, 257, 40)
NEW_TOKENS = 32
RUNS = {
    1.0: ("tp1:world1", "tp1-stock:world1"),
    0.7: ("tp1:world1", "tp1-eager:world1", "tp1:world1-stock"),
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """t -> (results by pair, samples by rollout) of the pairs RUNS[t] names, run on first use
    (so `-k` can take one temperature's tests alone)."""
    work = tmp_path_factory.mktemp("one-gpu")
    done: dict[float, tuple[dict, dict]] = {}

    def at(t: float) -> tuple[dict, dict]:
        if t in done:
            return done[t]
        run = ParityRun(config=str(CONFIG), workdir=work, new_tokens=NEW_TOKENS, temperature=t,
                        prompt_lengths=LENGTHS, seed=1, timeout=900, row_digests=True)  # fmt: skip
        # A control that fails to start does not hide the exact pairs' verdicts: run_pairs
        # gives a dead process's pairs its error (their tests re-raise it), and the pairs
        # sharing a trainer layout share one job.
        found = run_pairs(run, [parse_pair(p) for p in RUNS[t]])
        results, samples = dict(zip(RUNS[t], found, strict=True)), {}
        for pair, r in results.items():
            if isinstance(r, WorkerError):
                print(f"T={t} {pair}: failed: {r}")
                continue
            first = "" if r.first is None else f"; {r.first.describe()}"
            print(f"T={t} {pair}: {r.equal} of {r.compared} equal, rows {r.rows_equal} of "
                  f"{r.rows_compared}{first}; {r.first_row}")  # fmt: skip
        for name in {p.split(":")[0] for p in RUNS[t]}:
            f = work / f"rollout-{name}-s1-1" / "samples.json"
            if f.exists():
                samples[name] = json.loads(f.read_text())
                f.rename(f.with_name(f"samples-t{t}.json"))
        done[t] = results, samples
        return done[t]

    return at


def verdict(results: dict, pair: str):
    """The pair's result; its run's error if it failed."""
    r = results[pair]
    if isinstance(r, Exception):
        raise r
    return r


@pytest.mark.parametrize("t", list(RUNS))
def test_exact_engine_with_graphs_equals_megatron(parity, t):
    results, samples = parity(t)
    r = verdict(results, "tp1:world1")
    assert samples["tp1"]["decode_graphs"] == "full"
    assert r.compared == len(LENGTHS) * NEW_TOKENS >= 512
    assert r.equal == r.compared, r.first.describe()
    # every compared position's whole row (151936 entries) by digest, computed alike
    assert r.rows_compared == r.compared and r.rows_equal == r.rows_compared, r.first_row


def test_a_graph_replay_gives_the_eager_bits(parity):
    results, samples = parity(0.7)
    # a failed rollout re-raises its own error here, not a missing key below
    r, _ = verdict(results, "tp1-eager:world1"), verdict(results, "tp1:world1")
    graph, eager = samples["tp1"], samples["tp1-eager"]
    assert graph["decode_graphs"] == "full" and eager["decode_graphs"] == "disabled"
    ids = [[s["output_ids"] for s in x["samples"]] for x in (graph, eager)]
    assert ids[0] == ids[1]
    bad = sum(n_differ(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]))
              for a, b in zip(graph["samples"], eager["samples"], strict=True))  # fmt: skip
    assert bad == 0
    assert r.equal == r.compared == len(LENGTHS) * NEW_TOKENS, r.first


def test_stock_cuda_engine_differs_and_names_the_first_mismatch(parity):
    results, _ = parity(1.0)
    r = verdict(results, "tp1-stock:world1")
    assert r.compared == len(LENGTHS) * NEW_TOKENS
    assert r.equal < r.compared and r.first is not None
    text = r.first.describe()
    print(f"stock control: {r.compared - r.equal} of {r.compared} differ; first: {text}")
    assert "0x" in text, text


def test_rows_of_the_stock_trainer_differ(parity):
    """The rows' control: the exact rollout's row digests against Megatron's local spec and
    torch's log_softmax on the same tokens."""
    results, _ = parity(0.7)
    r = verdict(results, "tp1:world1-stock")
    assert r.rows_compared == len(LENGTHS) * NEW_TOKENS and r.rows_equal < r.rows_compared
    assert "row digest 0x" in r.first_row, r.first_row
