"""A decode step of the reference model captured in a CUDA graph replays the eager step's bits.

Qwen3-30B-A3B's shapes with 2 layers: paged attention from device tensors (tables, lengths,
cu_seqlens), contexts that cross a KV partition, the small-batch MoE schedule (1 request) and
the sorted one (40). The capture itself shows the step never reads the device from the host (a
sync inside a capture fails it)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch
from onpolicy import kernels as K
from onpolicy.bench.kernels import captured
from onpolicy.bits import assert_bitwise
from onpolicy.kernels.cuda import moe as M
from onpolicy.models.qwen3_moe_config import QWEN3_30B_A3B
from onpolicy.models.reference import PagedKVCache, Qwen3MoeReference, Request

pytestmark = pytest.mark.gpu
CFG = replace(QWEN3_30B_A3B, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model():
    return Qwen3MoeReference.random(CFG, dtype=torch.bfloat16, device="cuda", seed=0)


@pytest.mark.parametrize("batch", [1, 40])
@torch.no_grad()
def test_a_captured_decode_step_replays_the_eager_bits(model, batch):
    ps, ctx, dev = 16, 600, "cuda"
    gen = torch.Generator(device=dev).manual_seed(batch)
    cache = PagedKVCache(CFG, torch.bfloat16, page_size=ps, num_pages=batch * -(-ctx // ps),
                         device=dev)  # fmt: skip
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    lens = [ctx - 37 * r % 200 for r in range(batch)]  # 401 .. 600 keys
    reqs = [Request(rid=r, prompt=[0] * n) for r, n in enumerate(lens)]
    tables = torch.zeros(batch, -(-ctx // ps), dtype=torch.long, device=dev)
    for i, (r, n) in enumerate(zip(reqs, lens, strict=True)):
        cache.reserve(r, n + 1)  # room for the step after
        tables[i, : len(r.pages)] = cache.page_table(r)
    last = torch.tensor(lens, device=dev) - 1
    page = tables[torch.arange(batch, device=dev), last // ps]
    kv_lens, cu = last + 1, torch.arange(batch + 1, device=dev)
    tokens = torch.randint(CFG.vocab_size, (batch,), device=dev, generator=gen)
    assert (batch * CFG.num_experts_per_tok <= M.SMALL_PAIRS) == (batch == 1)

    def attend(batch: K.PagedBatch, layer: int, q, k, v):
        cache.k[layer, page, last % ps] = k
        cache.v[layer, page, last % ps] = v
        return K.paged_attention(q, cache.k[layer], cache.v[layer], batch)

    def step() -> torch.Tensor:  # a new batch each step: its schedule is part of the graph
        return model(tokens, last, partial(attend, K.PagedBatch(cu, tables, kv_lens)))

    eager = step().clone()
    graph, out = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, eager, "replay")
    tokens.copy_(torch.randint(CFG.vocab_size, (batch,), device=dev, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    assert not torch.equal(fresh, eager), "new tokens gave the old logits"
    assert_bitwise(out, fresh, "replay with new tokens in the captured buffer")

    # The next step, every request one key longer, written into the captured buffers: the
    # attention schedule is derived inside the step, so the replay follows the new lengths.
    # Control: a graph of a batch derived before its capture replays the old schedule.
    stale = K.PagedBatch(cu, tables, kv_lens)
    model(tokens, last, partial(attend, stale))  # derives the schedule, outside any graph
    stale_graph, stale_out = captured(lambda: model(tokens, last, partial(attend, stale)))
    last.add_(1)
    kv_lens.add_(1)
    page.copy_(tables[torch.arange(batch, device=dev), last // ps])
    graph.replay()
    stale_graph.replay()
    torch.cuda.synchronize()
    longer = step()
    assert not torch.equal(longer, fresh), "one more key gave the old logits"
    assert_bitwise(out, longer, "replay with one more key per request")
    assert not torch.equal(stale_out, longer), "a schedule derived before capture followed"


LOCAL_SETS = {"range": range(4, 12), "set": (4, 5, 6, 7, 8, 9, 10, 11)}
"""The rollout's own (a range: comparisons) and any other set (a mask gathered)."""


@pytest.mark.parametrize("local_set", list(LOCAL_SETS))
@pytest.mark.parametrize("tokens", [1, 40])
@torch.no_grad()
def test_expert_outputs_of_local_experts_capture_and_replay(tokens, local_set):
    """The rollout's EP path (`local_experts`) inside a capture: after one eager call (SGLang
    warms up before it captures) the step makes no host-to-device copy and no sync, so the
    capture holds, and a replay gives the eager bits (small-batch schedule at 1 token, sorted
    at 40)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, inter, k = 16, 256, 128, 8
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(tokens)])
    wg, wu = (torch.randn(e, inter, h, device="cuda", dtype=torch.bfloat16, generator=g) / 16
              for _ in range(2))  # fmt: skip
    wd = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=g) / 16
    local = LOCAL_SETS[local_set]

    def step() -> torch.Tensor:
        return K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=local)

    eager = step().clone()
    graph, out = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, eager, "replay")
    assert bool((eager[(ids < 4) | (ids >= 12)] == 0).all())  # non-local slots stay zero


REPLAY = """
import sys, torch
from onpolicy import kernels as K
from onpolicy.bench.kernels import captured
op, dev, bf = sys.argv[1], "cuda", torch.bfloat16
index = torch.tensor([3, 5], device=dev)  # positions, token ids or slots: 64 of each
q = torch.randn(2, 32, 128, device=dev, dtype=bf)
k, v = torch.randn(2, 2, 4, 128, device=dev, dtype=bf)
if op in ("qk_norm_rope", "rope"):
    table = K.rope_table(128, 1e6, 64).cuda()
    w = torch.ones(128, device=dev, dtype=bf)
    fn = {"qk_norm_rope": lambda: K.qk_norm_rope(q, k, w, w, 1e-6, index, table)[0],
          "rope": lambda: K.rope(q, index, table)}[op]
elif op == "embedding":
    weight = torch.randn(64, 256, device=dev, dtype=bf)
    fn = lambda: K.embedding(index, weight)
else:
    caches = torch.zeros(2, 64, 4, 128, device=dev, dtype=bf)
    fn = lambda: K.kv_store(caches[0], caches[1], index, k, v)
graph, _ = captured(fn)
graph.replay()
torch.cuda.synchronize()
print("in range: replayed", flush=True)
index[1] = int(sys.argv[2])
graph.replay()
torch.cuda.synchronize()
if op == "kv_store":
    assert torch.equal(caches[0][index], k) and torch.equal(caches[1][index], v)
print("written: replayed", flush=True)
"""
MESSAGES = {
    "qk_norm_rope": "rope: a position is outside the table",
    "rope": "rope: a position is outside the table",
    "embedding": "embedding: a token id is outside the vocab",
    "kv_store": "kv_store: a slot is outside the cache",
}
"""Op -> the message its kernel's device-side assert prints."""


@pytest.mark.parametrize("value", [63, 64, -1])
@pytest.mark.parametrize("op", list(MESSAGES))
def test_a_captured_index_is_asserted_on_the_device(op, value):
    """A graph reads no positions, token ids or KV slots on the host: the kernel that loads one
    asserts it on the device (no extra launch). A replay whose buffer holds one past the 64 of
    the table, vocab or cache, or a negative one, fails with the kernel's message (in a child:
    a device assert ends its CUDA context); the control, the last of the 64, replays (a KV
    store lands at its slot)."""
    proc = subprocess.run([sys.executable, "-c", REPLAY, op, str(value)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "in range: replayed" in proc.stdout, out[-3000:]
    if 0 <= value < 64:
        assert proc.returncode == 0 and "written: replayed" in proc.stdout, out[-3000:]
    else:
        assert proc.returncode != 0 and "written: replayed" not in proc.stdout, out[-3000:]
        assert "device-side assert triggered" in out and MESSAGES[op] in out, out[-3000:]
