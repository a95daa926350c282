"""The exact path's CUDA-graph rule (`rollout.switch`): on CUDA decode batches replay 'full'
graphs and prefill stays eager; a CPU engine takes no graphs. The backend each phase would get
follows SGLang's precedence (global switch, per-phase off-switches, per-phase backends, an
explicit `cuda_graph_config`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from onpolicy.contract.errors import ContractError
from onpolicy.rollout.engine import exact_engine_args
from onpolicy.rollout.switch import _check_graphs, graph_backends


def _args(device: str, **over) -> SimpleNamespace:
    return SimpleNamespace(**(exact_engine_args("/ckpt", device=device) | over))


@pytest.mark.parametrize(("device", "want"), [
    ("cuda", {"decode": "full", "prefill": "disabled"}),
    ("cpu", {"decode": "disabled", "prefill": "disabled"}),
])  # fmt: skip
def test_the_engine_arguments_are_on_the_rule(device, want):
    args = _args(device)
    assert graph_backends(args) == want
    _check_graphs(args)


@pytest.mark.parametrize(("device", "over", "phase", "backend"), [
    ("cuda", {"disable_prefill_cuda_graph": False}, "prefill", "breakable"),
    ("cuda", {"cuda_graph_backend_decode": "breakable"}, "decode", "breakable"),
    ("cuda", {"cuda_graph_config": {"prefill": {"backend": "full"}}}, "prefill", "full"),
    ("cpu", {"disable_cuda_graph": False}, "decode", "full"),
    ("cpu", {"disable_cuda_graph": False, "disable_decode_cuda_graph": True,
             "cuda_graph_backend_prefill": "full"}, "prefill", "full"),
])  # fmt: skip
def test_graphs_off_the_rule_are_refused_by_name(device, over, phase, backend):
    args = _args(device, **over)
    assert graph_backends(args)[phase] == backend
    with pytest.raises(ContractError) as err:
        _check_graphs(args)
    msg = str(err.value)
    assert "[rollout_cuda_graphs]" in msg, msg
    assert f"{phase} CUDA-graph backend would be {backend!r}" in msg, msg


def test_an_explicit_config_wins_over_the_flags():
    args = _args("cuda", disable_cuda_graph=True,
                 cuda_graph_config={"decode": {"backend": "full", "max_bs": 64}})  # fmt: skip
    assert graph_backends(args) == {"decode": "full", "prefill": "disabled"}
    _check_graphs(args)
