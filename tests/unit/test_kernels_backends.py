"""One backend surface: the CPU, CUDA and native backends export the same flat primitive names,
every public op maps to one of them by `kernels._OPS`, and a missing backend or primitive is a
NotImplementedError naming the op and the device. The CUDA surface is only imported here
(Triton imports without a GPU); its kernels run in the interpreted and GPU tests."""

from __future__ import annotations

import importlib

import pytest
import torch
from onpolicy import kernels as K
from onpolicy.kernels import native
from onpolicy.kernels.cpu import ops as cpu_ops

SURFACES = ["onpolicy.kernels.cpu.ops", "onpolicy.kernels.cuda.ops", "onpolicy.kernels.native"]


@pytest.mark.parametrize("name", SURFACES)
def test_every_backend_exports_the_same_primitives(name):
    surface = importlib.import_module(name)
    assert sorted(surface.__all__) == sorted(set(K._OPS.values())), name
    assert all(callable(getattr(surface, p)) for p in surface.__all__), name


def test_every_public_op_is_in_the_table():
    public = {
        n for n in K.__all__ if callable(getattr(K, n)) and not isinstance(getattr(K, n), type)
    }
    shared = {"combine_partials", "k_segments", "native_ops", "pairwise_tree_sum", "rope_table",
              "row_parallel_exact", "scale_logits", "tree_sum", "vocab_parallel_exact",
              "vocab_segments"}  # fmt: skip
    assert public - shared == set(K._OPS)


def test_each_op_resolves_to_its_backend_primitive():
    x = torch.zeros(1)
    assert all(K._impl(op, x) is getattr(cpu_ops, p) for op, p in K._OPS.items())
    with K.native_ops():
        assert all(K._impl(op, x) is getattr(native, p) for op, p in K._OPS.items())


def test_unknown_device_names_the_op_and_the_device():
    x = torch.zeros(2, 4, device="meta")
    with pytest.raises(NotImplementedError, match=r"onpolicy\.kernels\.moe_route: .*'meta'"):
        K.moe_route(x, torch.zeros(3, 4, device="meta"), 1)


def test_missing_primitive_names_the_op_and_the_device(monkeypatch):
    monkeypatch.delattr(cpu_ops, "combine")
    with pytest.raises(NotImplementedError, match=r"onpolicy\.kernels\.moe_combine: .*'cpu'"):
        K.moe_combine(torch.zeros(2, 1, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))


def test_host_launch_arithmetic_is_tritons():
    """`rules.cdiv` and `rules.next_power_of_2` (plain host functions, where Triton's are
    constexpr functions costing about 2 us a host call) give Triton's values."""
    import triton
    from onpolicy.kernels.rules import cdiv, next_power_of_2

    for a in range(0, 600):
        assert next_power_of_2(a + 1) == triton.next_power_of_2(a + 1), a + 1
        for b in (1, 2, 3, 16, 64, 127, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
