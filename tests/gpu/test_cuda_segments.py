"""The segment rule on CUDA for segments of any width: every (K, S, tp) that
`row_parallel_exact` accepts gives the unsharded bits, also where a segment is not a whole
number of K chunks (48, 96, 192 wide) and where it is one chunk or less.

The negative control runs the same harness with the kernel's seal off: Triton then rewrites
`partial + dot(a, b, 0)` as `dot(a, b, partial)` for a segment whose chunk loop folds away, so
the unsharded kernel no longer starts that segment from zero and the shards disagree with it.
"""

from __future__ import annotations

import pytest
import torch
from adversarial import wide
from onpolicy import kernels as K
from onpolicy.kernels.cuda import linear as L

pytestmark = pytest.mark.gpu

WIDTHS = (16, 48, 96, 192, 128)
"""Segment widths: 48 and 96 are under one 128-wide chunk, 96 and 192 no whole number of 64-
or 128-wide chunks, 128 exactly one chunk; 16 is one chunk of an fp32 launch (16-wide chunks,
`linear.launch_tile`), where the wider ones are several."""
ROWS = (5, 300, 1000)
"""M on each of the GEMM's tile classes (small: 128-wide chunks, mid, large: 64-wide; fp32:
16-wide at each)."""
CONTROL = {torch.bfloat16: (768, 8), torch.float32: (128, 8)}
"""(K, S) of the seal's control per dtype, segments of one chunk: Qwen3-30B-A3B's expert K = 768
at S = 8 in bf16 (96 wide, one chunk at the small-M tile), 16 wide in fp32."""


def _cases():
    """Every S, at tp 2 and at tp = S (one segment per shard, the case the seal is for); each
    is accepted by the rule."""
    for width in WIDTHS:
        for s in (2, 4, 8):
            for tp in sorted({2, s}):
                assert K.row_parallel_exact(width * s, tp, s)
                yield width, s, tp


@pytest.fixture
def unsealed():
    """Run with the seal off, restoring it."""
    L.SEAL = False
    yield
    L.SEAL = True


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _differ(x: torch.Tensor, w: torch.Tensor, s: int, tp: int) -> int:
    """Outputs where tp shards plus the tree differ from the unsharded S-segment kernel."""
    sharded = K.row_parallel_linear(x, w, tp, segments=s)
    whole = K.linear(x, w, segments=s)
    return int((_bits(sharded) != _bits(whole)).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("width", "s", "tp"), list(_cases()))
def test_shards_of_any_segment_width_are_exact(width, s, tp, dtype):
    k = width * s
    assert L.SEAL
    for m in ROWS:
        x = wide(m, k, seed=k + m, dtype=dtype, device="cuda")
        w = wide(96, k, seed=k + 1, dtype=dtype, spread=4, device="cuda")
        assert _differ(x, w, s, tp) == 0, f"K {k} S {s} tp {tp} M {m} {dtype}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_negative_control_without_the_seal_shards_differ(unsealed, dtype):
    """Segments of one chunk each (`CONTROL`; in bf16 the case an H200 check found broken),
    one per shard: without the seal the same harness counts differing outputs."""
    k, s = CONTROL[dtype]
    w = wide(96, k, seed=8, dtype=dtype, spread=4, device="cuda")
    counts = [_differ(wide(m, k, seed=7 + m, dtype=dtype, device="cuda"), w, s, s)
              for m in ROWS]  # fmt: skip
    print(f"unsealed, {dtype}, K {k} S {s}: differing outputs at M {ROWS}: {counts}")
    assert sum(counts) > 0, counts


def test_negative_control_the_plain_gemm_is_not_the_segment_tree():
    """The unsegmented GEMM (S = 1) is another order than 8 shards of one segment each."""
    x = wide(33, 768, seed=7, dtype=torch.bfloat16, device="cuda")
    w = wide(96, 768, seed=8, dtype=torch.bfloat16, spread=4, device="cuda")
    plain = K.linear(x, w)
    assert int((_bits(K.row_parallel_linear(x, w, 8, segments=8)) != _bits(plain)).sum()) > 0
