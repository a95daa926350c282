"""`kernels.kv_store`: the new keys' and values' rows land at their slots of a paged cache with
their own bits, read in place from one qkv row, and nothing else in the cache changes; the plain
op (two `index_copy_`) gives the same cache. Bad shapes, dtypes, devices and layouts are
refused, naming them. A copy has no rounding to control: the comparison that can fail is shown
failing on a store at the wrong slots."""

from __future__ import annotations

import pytest
import torch
from adversarial import DEVICES
from onpolicy import kernels as K
from onpolicy.bits import assert_bitwise, bitwise_equal

DTYPES = [torch.bfloat16, torch.float32]
SLOTS, HQ, HKV, D, N = 96, 8, 4, 128, 5


def _case(device: str, dtype: torch.dtype, seed: int = 0):
    """Caches of random bits, and N rows of k and v as views into one qkv row each."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(SLOTS, HKV, D, generator=gen).to(dtype) for _ in range(2))
    qkv = torch.randn(N, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    slots = torch.randperm(SLOTS, generator=gen)[:N]
    k_cache, v_cache, qkv, slots = (t.to(device) for t in (k_cache, v_cache, qkv, slots))
    _, k, v = qkv.view(N, -1, D).split([HQ, HKV, HKV], dim=1)
    return k_cache, v_cache, slots, k, v


def _expected(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The cache with rows written one at a time at their slots."""
    out = cache.clone()
    for i, s in enumerate(slots.tolist()):
        out[s] = rows[i]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_rows_land_at_their_slots_and_nothing_else_changes(device, dtype):
    k_cache, v_cache, slots, k, v = _case(device, dtype)
    assert not k.is_contiguous() and not v.is_contiguous()  # read in place from the qkv row
    want_k, want_v = _expected(k_cache, slots, k), _expected(v_cache, slots, v)
    K.kv_store(k_cache, v_cache, slots, k, v)
    assert_bitwise(k_cache, want_k, "keys")
    assert_bitwise(v_cache, want_v, "values")
    # Control: the same comparison fails for a store one slot off.
    off_k, off_v = _case(device, dtype)[:2]
    K.kv_store(off_k, off_v, (slots + 1) % SLOTS, k, v)
    assert not bitwise_equal(off_k, want_k) and not bitwise_equal(off_v, want_v)


@pytest.mark.parametrize("device", DEVICES)
def test_the_plain_op_gives_the_same_cache(device):
    k_cache, v_cache, slots, k, v = _case(device, torch.bfloat16, seed=1)
    plain_k, plain_v = k_cache.clone(), v_cache.clone()
    K.kv_store(k_cache, v_cache, slots.int(), k, v)  # int32 slots as well
    with K.native_ops():
        K.kv_store(plain_k, plain_v, slots, k, v)
    assert_bitwise(k_cache, plain_k, "keys")
    assert_bitwise(v_cache, plain_v, "values")


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_store_changes_nothing(device):
    k_cache, v_cache, slots, k, v = _case(device, torch.bfloat16, seed=2)
    before = k_cache.clone(), v_cache.clone()
    K.kv_store(k_cache, v_cache, slots[:0], k[:0], v[:0])
    assert_bitwise(k_cache, before[0], "keys")
    assert_bitwise(v_cache, before[1], "values")


def _bad_v(c):
    return c[0], c[1], c[2], c[3], c[4][:, :2]


BAD = {
    "v's shape": (_bad_v, r"k \(5, 4, 128\) and v \(5, 2, 128\)"),
    "the cache's heads": (
        lambda c: (c[0][:, :2], c[1][:, :2], *c[2:]),
        r"caches \(96, 2, 128\) and \(96, 2, 128\) must both be \[slots, 4, 128\]",
    ),
    "a slot short": (
        lambda c: (c[0], c[1], c[2][:4], c[3], c[4]),
        r"slots \(4,\) torch.int64 must be one int32 or int64 slot per row \(5 rows\)",
    ),
    "float slots": (
        lambda c: (c[0], c[1], c[2].float(), c[3], c[4]),
        r"slots \(5,\) torch.float32",
    ),
    "the cache's dtype": (
        lambda c: (c[0].float(), c[1].float(), *c[2:]),
        r"rows torch.bfloat16/torch.bfloat16 into caches torch.float32/torch.float32",
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", list(BAD))
def test_a_store_that_does_not_fit_is_refused_naming_it(device, bad):
    case = _case(device, torch.bfloat16, seed=3)
    before = case[0].clone(), case[1].clone()
    make, message = BAD[bad]
    with pytest.raises(ValueError, match=message):
        K.kv_store(*make(case))
    assert_bitwise(case[0], before[0], "keys untouched")
    assert_bitwise(case[1], before[1], "values untouched")


def test_a_slot_outside_the_cache_is_refused_on_cpu():
    """On CPU `index_copy_` checks each slot; on CUDA the kernel's device-side assert does
    (tests/gpu/test_cuda_graph.py)."""
    k_cache, v_cache, slots, k, v = _case("cpu", torch.bfloat16, seed=4)
    slots[2] = SLOTS
    with pytest.raises(IndexError, match="out of range|out of bounds"):
        K.kv_store(k_cache, v_cache, slots, k, v)


@pytest.mark.gpu
def test_caches_of_two_layouts_are_refused_on_cuda():
    k_cache, v_cache, slots, k, v = _case("cuda", torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="must share one layout with unit stride"):
        K.kv_store(k_cache, v_cache.transpose(0, 1).contiguous().transpose(0, 1), slots, k, v)
