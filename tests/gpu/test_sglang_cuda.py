"""SGLang on CUDA, TP1, the exact path with decode CUDA graphs, chunked prefill and the radix
cache on, against Megatron at world 1 on the same tokens from the same checkpoint:
`onpolicy parity` with configs/one-gpu.toml (Qwen3-30B-A3B's layer dims, 4 layers, seeded).

16 co-batched prompts of 1 to 2049 tokens, 32 new tokens each (512 compared per rollout):
- at T = 1.0 and 0.7 every generated token's log-prob equals the trainer's in its bits;
- at T = 0.7 the same engine without graphs (eager decode) gives the same tokens and bits, so a
  replay is the eager step;
- the negative control, SGLang's stock CUDA path (triton attention, its own ops) against the
  same trainer, reports mismatches and names the first in hex.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from onpolicy.bits import n_differ
from onpolicy.parity import ParityRun, parse_pair, run_pairs

pytestmark = pytest.mark.gpu
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "one-gpu.toml"
LENGTHS = (1, 2049, 300, 17, 1024, 5, 64, 2, 700, 33, 128, 9, 1500, 3, 257, 40)
NEW_TOKENS = 32
RUNS = {1.0: ("tp1:world1", "tp1-stock:world1"), 0.7: ("tp1:world1", "tp1-eager:world1")}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    work = tmp_path_factory.mktemp("one-gpu")
    results, samples = {}, {}
    for t, pairs in RUNS.items():
        run = ParityRun(config=str(CONFIG), workdir=work, new_tokens=NEW_TOKENS, temperature=t,
                        prompt_lengths=LENGTHS, seed=1, timeout=900)  # fmt: skip
        for r in run_pairs(run, [parse_pair(p) for p in pairs]):
            results[(t, r.pair)] = r
            first = "" if r.first is None else f"; {r.first.describe()}"
            print(f"T={t} {r.pair}: {r.equal} of {r.compared} equal{first}")
        for name in ("tp1", "tp1-eager", "tp1-stock"):
            f = work / f"rollout-{name}-s1-1" / "samples.json"
            if f.is_file():
                samples[(t, name)] = json.loads(f.read_text())
                f.rename(f.with_name(f"samples-t{t}.json"))
    return results, samples


@pytest.mark.parametrize("t", sorted(RUNS))
def test_exact_engine_with_graphs_equals_megatron(parity, t):
    results, samples = parity
    r = results[(t, "tp1:world1")]
    assert samples[(t, "tp1")]["decode_graphs"] == "full"
    assert r.compared == len(LENGTHS) * NEW_TOKENS >= 512
    assert r.equal == r.compared, r.first.describe()


def test_a_graph_replay_gives_the_eager_bits(parity):
    results, samples = parity
    graph, eager = samples[(0.7, "tp1")], samples[(0.7, "tp1-eager")]
    assert graph["decode_graphs"] == "full" and eager["decode_graphs"] == "disabled"
    ids = [[s["output_ids"] for s in x["samples"]] for x in (graph, eager)]
    assert ids[0] == ids[1]
    bad = sum(n_differ(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]))
              for a, b in zip(graph["samples"], eager["samples"], strict=True))  # fmt: skip
    assert bad == 0
    r = results[(0.7, "tp1-eager:world1")]
    assert r.equal == r.compared == len(LENGTHS) * NEW_TOKENS, r.first


def test_stock_cuda_engine_differs_and_names_the_first_mismatch(parity):
    results, _ = parity
    r = results[(1.0, "tp1-stock:world1")]
    assert r.compared == len(LENGTHS) * NEW_TOKENS
    assert r.equal < r.compared and r.first is not None
    text = r.first.describe()
    print(f"stock control: {r.compared - r.equal} of {r.compared} differ; first: {text}")
    assert "0x" in text, text
