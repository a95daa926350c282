"""MoE: stable top-k (ties to the lower expert id), a token's output independent of the batch and
of which EP rank hosts which expert, combine in expert-id order; backward vs autograd.

The experts span several K-blocks (hidden 384 = 3 blocks, expert width 256 = 2), every token
picks 4 experts with spread-out routing weights, and the inputs have wide exponents: so the
expert GEMMs have multi-block trees, and a different order of a token's 4 slot terms changes
its bits. Each property is a harness returning mismatch reports; its negative control runs the
same harness on the plain op (`K.native_ops()`, one thread) or with the plain EP combine, and
asserts that it breaks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from adversarial import (
    DEVICES,
    DTYPES,
    PROPERTY,
    assert_bitwise,
    bitwise_equal,
    mismatch_report,
    n_differ,
    one_thread,
)
from adversarial import wide as _wide
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy import kernels as K

E, H, INTER, TOP = 8, 384, 256, 4
ROUTER_SCALE = 2.0**-8
"""Keeps router logits O(1) on these inputs, so a token's 4 weights are all far from 0 (the
smallest is 0.07 .. 0.19 for most tokens) and every slot term counts in the combine."""

# A narrower exponent spread: router logits and expert products stay finite in bf16.
wide = partial(_wide, spread=6)


def experts(seed: int, dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    # Scaled on the CPU, then moved: the same bits on every device.
    return {
        "gate_weight": (wide(E, H, seed=seed, spread=2) * ROUTER_SCALE).to(dtype).to(device),
        "w_gate": (wide(E, INTER, H, seed=seed + 1, spread=1) * 0.05).to(dtype).to(device),
        "w_up": (wide(E, INTER, H, seed=seed + 2, spread=1) * 0.05).to(dtype).to(device),
        "w_down": (wide(E, H, INTER, seed=seed + 3, spread=1) * 0.05).to(dtype).to(device),
    }


def run(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return K.moe(x, w["gate_weight"], w["w_gate"], w["w_up"], w["w_down"], TOP)


# --- router -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_topk_ties_go_to_the_lower_expert_id(device):
    """Equal router logits (bf16 makes them common) pick the lowest ids, best first."""
    gate = torch.zeros(E, H, device=device)
    gate[[2, 5, 6]] = 1.0  # experts 2, 5, 6 tie for the top score
    x = torch.ones(3, H, device=device)
    ids, weights = K.moe_route(x, gate, 2)
    assert ids.tolist() == [[2, 5]] * 3
    assert_bitwise(weights, torch.full((3, 2), 0.5, device=device), "tied weights")
    ids, _ = K.moe_route(x, gate, 4)
    assert ids.tolist() == [[2, 5, 6, 0]] * 3


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_torch_topk_breaks_ties_arbitrarily(device):
    """Neither the CPU nor the CUDA torch.topk returns tied values in index order."""
    probs = torch.tensor([1.0, 2, 2, 1, 2] * 20, device=device)
    assert torch.topk(probs, 3).indices.tolist() != [1, 2, 4]
    assert torch.sort(probs, descending=True, stable=True).indices[:3].tolist() == [1, 2, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_router_matches_hf_softmax_topk_renormalise(device):
    torch.manual_seed(0)
    x, gate = torch.randn(50, H).to(device), (torch.randn(E, H) * H**-0.5).to(device)
    ids, weights = K.moe_route(x, gate, TOP)
    probs = torch.softmax(x @ gate.T, -1)
    ref_w, ref_ids = torch.topk(probs, TOP)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights, ref_w / ref_w.sum(-1, keepdim=True))


# --- batch invariance -------------------------------------------------------------------------
def batch_reports(x: torch.Tensor, w: dict[str, torch.Tensor], rows: list[int]) -> list[str]:
    """moe of the batch against each of `rows` alone, and against the batch reversed."""
    out = run(x, w)
    reports = []
    for i in rows:
        alone = run(x[i : i + 1], w)[0]
        if not bitwise_equal(alone, out[i]):
            reports.append(f"token {i} alone: {mismatch_report(alone, out[i])}")
    flipped = run(x.flip(0), w).flip(0)
    if not bitwise_equal(flipped, out):
        reports.append(f"batch reversed: {mismatch_report(flipped, out)}")
    return reports


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=40)
@given(m=st.integers(1, 24), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_token_output_is_independent_of_the_batch(device, m, dtype, seed):
    w = experts(seed, dtype, device)
    x = wide(m, H, seed=seed + 9, dtype=dtype, device=device)
    reports = batch_reports(x, w, sorted({0, m // 2, m - 1}))
    assert not reports, "\n".join(reports)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_negative_control_hf_moe_depends_on_the_batch(seed):
    """The same harness on the plain MoE (HF's loop: F.linear per expert on that expert's
    tokens, index_add of the weighted outputs): in fp32 a lone token runs MKL's one-row kernel,
    so its bits differ from the batch's. (bf16 F.linear rounds once at the end and holds here.)"""
    w = experts(seed, torch.float32)
    x = wide(64, H, seed=seed + 9)
    rows = [0, 31, 63]
    with one_thread(), K.native_ops():
        reports = batch_reports(x, w, rows)
    assert len([r for r in reports if "alone" in r]) == len(rows), reports


# --- expert parallelism -----------------------------------------------------------------------
def rank_experts(owner: torch.Tensor, r: int) -> list[int]:
    return torch.nonzero(owner == r)[:, 0].tolist()


def rank_slots(x, ids, w, owner: torch.Tensor, ep: int) -> list[torch.Tensor]:
    """Each simulated rank's [T, k, H] slot outputs for the experts `owner` gives it."""
    wg, wu, wd = w["w_gate"], w["w_up"], w["w_down"]
    return [K.moe_expert_outputs(x, ids, wg, wu, wd, local_experts=rank_experts(owner, r))
            for r in range(ep)]  # fmt: skip


EpCombine = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def merged_combine(per_rank, ids, weights, owner) -> torch.Tensor:
    """The exact EP path: each slot taken from its expert's rank, then the expert-id tree."""
    return K.moe_combine(K.moe_merge_expert_parallel(per_rank, ids, owner), ids, weights)


def rank_local_then_all_reduce(per_rank, ids, weights, owner) -> torch.Tensor:
    """A plain EP combine: each rank sums its own weighted slots (fp32, rounded to the output
    dtype), then the ranks' partials are summed left to right in that dtype (an all-reduce)."""
    partials = [(weights[..., None] * (owner[ids] == r)[..., None] * slots.float()).sum(1)
                .to(slots.dtype) for r, slots in enumerate(per_rank)]  # fmt: skip
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total


def in_arrival_order(per_rank, ids, weights, owner) -> torch.Tensor:
    """A plain EP combine: a token's weighted slot outputs added left to right in the order
    they come back from the all-to-all (by owning rank, then slot), in the output dtype."""
    slots = K.moe_merge_expert_parallel(per_rank, ids, owner)
    order = torch.sort(owner[ids], dim=-1, stable=True).indices
    w = weights.gather(1, order)[..., None]
    terms = (w * slots.gather(1, order[..., None].expand_as(slots)).float()).to(slots.dtype)
    total = terms[:, 0]
    for s in range(1, terms.shape[1]):
        total = total + terms[:, s]
    return total


def ep_reports(x, w, layouts: list[torch.Tensor], ep: int, combine: EpCombine) -> list[str]:
    """The EP result of every expert-to-rank layout against the same path on one rank."""
    ids, weights = K.moe_route(x, w["gate_weight"], TOP)
    one_rank = torch.zeros(E, dtype=torch.long, device=x.device)
    ref = combine(rank_slots(x, ids, w, one_rank, 1), ids, weights, one_rank)
    reports = []
    for owner in layouts:
        got = combine(rank_slots(x, ids, w, owner, ep), ids, weights, owner)
        if not bitwise_equal(got, ref):
            reports.append(f"layout {owner.tolist()}: {mismatch_report(got, ref)}")
    return reports


def layouts(ep: int, seed: int, n: int = 3, device: str = "cpu") -> list[torch.Tensor]:
    """Any assignment of experts to ranks, not only contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randperm(E, generator=gen) % ep).to(device) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@settings(PROPERTY, max_examples=30)
@given(
    ep=st.sampled_from([1, 2, 4, 8]),
    layout_seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_token_output_is_independent_of_which_rank_hosts_which_expert(
    device, ep, layout_seed, dtype, seed
):
    w = experts(seed, dtype, device)
    x = wide(16, H, seed=seed + 9, dtype=dtype, device=device)
    reports = ep_reports(x, w, layouts(ep, layout_seed, device=device), ep, merged_combine)
    assert not reports, "\n".join(reports)
    ids, weights = K.moe_route(x, w["gate_weight"], TOP)
    one_rank = torch.zeros(E, dtype=torch.long, device=device)
    assert_bitwise(merged_combine(rank_slots(x, ids, w, one_rank, 1), ids, weights, one_rank),
                   run(x, w), "one rank vs moe")  # fmt: skip


@pytest.mark.parametrize("combine", [rank_local_then_all_reduce, in_arrival_order])
@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_plain_ep_combines_depend_on_the_layout(combine, ep, dtype):
    """The same harness with a plain EP combine: the order of a token's 4 slot terms follows
    the ranks, so every layout changes bits against one rank, and against another layout."""
    w = experts(1, dtype)
    x = wide(64, H, seed=2, dtype=dtype)
    owners = layouts(ep, seed=ep)
    reports = ep_reports(x, w, owners, ep, combine)
    assert len(reports) == len(owners), reports
    assert ep_reports(x, w, owners[1:], ep, merged_combine) == []
    ids, weights = K.moe_route(x, w["gate_weight"], TOP)
    a, b = (combine(rank_slots(x, ids, w, o, ep), ids, weights, o) for o in owners[:2])
    assert n_differ(a, b) > 0


# --- combine order ----------------------------------------------------------------------------
def permutation_reports(outs, ids, weights, perms) -> list[str]:
    """moe_combine with each token's slots permuted by each of `perms`, against unpermuted."""
    ref = K.moe_combine(outs, ids, weights)
    reports = []
    for p in perms:
        p = torch.tensor(p, device=outs.device)
        got = K.moe_combine(outs[:, p], ids[:, p], weights[:, p])
        if not bitwise_equal(got, ref):
            reports.append(f"slots {p.tolist()}: {mismatch_report(got, ref)}")
    return reports


def routed_slots(seed: int, dtype, device: str = "cpu"):
    """Real expert outputs of 32 tokens and their routing: [T, 4, H] slots, ids, weights."""
    w = experts(seed, dtype, device)
    x = wide(32, H, seed=seed + 9, dtype=dtype, device=device)
    ids, weights = K.moe_route(x, w["gate_weight"], TOP)
    return K.moe_expert_outputs(x, ids, w["w_gate"], w["w_up"], w["w_down"]), ids, weights


ALL_PERMS = list(itertools.permutations(range(TOP)))[1:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_order_is_expert_id_order_not_score_order(device, dtype):
    reports = permutation_reports(*routed_slots(5, dtype, device), ALL_PERMS)
    assert not reports, "\n".join(reports)


def test_negative_control_torch_combine_depends_on_the_slot_order():
    """The same harness on the plain fp32 combine (a sum over the slot dim, in slot = score
    order): every reordering of a token's 4 terms changes some outputs, but for the one a
    left-to-right sum cannot see (the first two swapped: a + b = b + a). In bf16 torch sums in
    fp32 and rounds once, which hides the order here."""
    with one_thread(), K.native_ops():
        reports = permutation_reports(*routed_slots(5, torch.float32), ALL_PERMS)
    assert len(reports) >= len(ALL_PERMS) - 1, reports


# --- accuracy and backward --------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_a_plain_moe_and_backward_matches_autograd(device, dtype):
    torch.manual_seed(0)
    w = {k: v.requires_grad_() for k, v in experts(6, dtype, device).items()}
    x = wide(12, H, seed=7, dtype=dtype, device=device).requires_grad_()
    out = run(x, w)
    ids, _ = K.moe_route(x.detach(), w["gate_weight"].detach(), TOP)
    ref_in = {k: v.detach().float().requires_grad_() for k, v in w.items()}
    xr = x.detach().float().requires_grad_()
    probs = torch.softmax(xr @ ref_in["gate_weight"].T, -1).gather(-1, ids)
    probs = probs / probs.sum(-1, keepdim=True)
    ref = torch.zeros(12, H, device=device)
    for s in range(TOP):
        e = ids[:, s]
        h = F.silu(torch.einsum("th,tih->ti", xr, ref_in["w_gate"][e]))
        h = h * torch.einsum("th,tih->ti", xr, ref_in["w_up"][e])
        ref = ref + probs[:, s, None] * torch.einsum("ti,thi->th", h, ref_in["w_down"][e])
    # bf16 rounds every intermediate, so it is held to a relative error in norm. On CUDA the
    # fp32 gradients come from cuBLAS, whose sums over wide-exponent inputs run in another
    # order than the reference's einsum: 1.6e-5 was seen, so fp32 is held to 1e-4 there.
    rel = 5e-2 if dtype == torch.bfloat16 else (1e-4 if device == "cuda" else 1e-5)

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        err = float((ours.detach().float() - theirs.detach()).norm() / theirs.detach().norm())
        assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"

    close(out, ref)
    g = torch.randn(12, H).to(device)
    (out.float() * g).sum().backward()
    (ref * g).sum().backward()
    close(x.grad, xr.grad)
    for k in w:
        # The router weight's gradient sums softmax-Jacobian terms that nearly cancel across
        # tokens; rounded to bf16 first, it is only meaningful to compare in fp32.
        if k != "gate_weight" or dtype == torch.float32:
            close(w[k].grad, ref_in[k].grad)
