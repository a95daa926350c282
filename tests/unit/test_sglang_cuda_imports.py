"""SGLang's CUDA load needs neither sgl-kernel nor flashinfer on the exact path.

The H200 test host can install neither (sglang-kernel is built for another torch). A subprocess
makes SGLang take its CUDA branches on this CPU machine (`torch.cuda.is_available`,
`torch.version.cuda` and an H200's device properties) and makes both packages absent as on
that host (None in `sys.modules`: `import` raises and `importlib.util.find_spec` answers None),
then imports the modules an exact engine loads: Engine, scheduler, TP worker, model runner,
CUDA-graph runners, memory pools, Qwen3-MoE with its layers, the sampler, the attention-backend
registry and onpolicy's side of each hook. The modules come from the applied series
(`build/upstream/sglang`, the tree the wheel is packed from), as in test_patch_series.py.

Negative control: the same harness over the same tree with only the files of
`fix_import_the_cuda_sgl_kernel_ops_only_when_sgl_kernel_is_installed` back at their
pre-patch text fails at an `sgl_kernel` import in one of those files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onpolicy.upstream import tree
from onpolicy.upstream.series import load_series

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PATCH = "fix_import_the_cuda_sgl_kernel_ops_only_when_sgl_kernel_is_installed.patch"

EXACT_PATH = [
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend",
    "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.models.registry",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.layers.rotary_embedding",
    "sglang.srt.layers.linear",
    "sglang.srt.layers.vocab_parallel_embedding",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.moe.topk",
    "sglang.srt.layers.moe.fused_moe_triton",
    "sglang.srt.layers.attention.attention_registry",
    "onpolicy.rollout.attention",
    "onpolicy.rollout.moe",
    "onpolicy.rollout.ops",
    "onpolicy.rollout.sampler",
]
"""Modules an exact engine loads at start, from Engine down to each hook's onpolicy side.
Measured on 2026-12-04: every sglang module a CPU exact engine loaded (1,443) imports in this
harness too, but for 7 that fail on CPU as well (cutlass, deep_gemm, sglang.private)."""

FAKE_H200 = r"""
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.get_device_name = lambda device=None: "NVIDIA H200"
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             total_memory=141 * 2**30, gcnArchName="", L2_cache_size=60 * 2**20)
torch.cuda.get_device_properties = lambda device=None: H200
"""
"""Harness lines that make torch report one H200 (SGLang's CUDA branches read these)."""

HARNESS = (
    r"""
import importlib, importlib.abc, importlib.util, json, sys, traceback, types
import torch

for name in ("sgl_kernel", "flashinfer"):
    sys.modules[name] = None  # absent: import raises, importlib.util.find_spec -> None
"""
    + FAKE_H200
    + r"""


class Text(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Serves the named modules from the given source text (the control's pre-patch files).
    def __init__(self, texts):
        self.texts = texts

    def find_spec(self, name, path=None, target=None):
        if name in self.texts:
            return importlib.util.spec_from_loader(name, self, origin=self.texts[name][0])

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        origin, text = self.texts[module.__name__]
        module.__file__ = origin
        exec(compile(text, origin, "exec"), module.__dict__)


plan = json.loads(open(sys.argv[1]).read())
if plan["texts"]:
    sys.meta_path.insert(0, Text(plan["texts"]))
out = {}
try:
    for m in plan["modules"]:
        importlib.import_module(m)
except ImportError as e:
    where = [f for f in traceback.extract_tb(e.__traceback__) if "/sglang/" in f.filename]
    out["error"] = f"{type(e).__name__}: {e}"
    out["at"] = f"{where[-1].filename}:{where[-1].lineno}" if where else "?"
    print(json.dumps(out))
    sys.exit(0)

from sglang.srt.utils import is_cuda
from sglang.srt.layers import layernorm, sampler
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.registry import ModelRegistry

out["cuda"] = is_cuda()
out["unavailable"] = [layernorm.rmsnorm is None, sampler.top_k_renorm_prob is None]
out["onpolicy_backend"] = ATTENTION_BACKENDS["onpolicy"].__code__.co_names
out["qwen3_moe"] = ModelRegistry.resolve_model_cls(["Qwen3MoeForCausalLM"])[0].__module__

# The RMSNorm hook, as a CUDA engine dispatches it (BaseFusedOp.forward picks the platform's
# method): does a call with the switch on reach onpolicy.rollout.ops.rms_norm?
# (The switch off is the control: the same call then reaches forward_cuda.)
import onpolicy.rollout.ops as ops
ops.rms_norm = lambda *args: "onpolicy"
for key, target in (("rms_norm", "onpolicy"), ("rms_norm_off", "")):
    ex = types.SimpleNamespace(deterministic=types.SimpleNamespace(rl_on_policy_target=target))
    layernorm.get_exec = lambda ex=ex: ex
    try:
        out[key] = layernorm.RMSNorm(8)(torch.ones(2, 8))
    except Exception as e:
        out[key] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""
)


def cuda_load(work: Path, tmp: Path, texts: dict[str, tuple[str, str]] | None = None) -> dict:
    """Run HARNESS over the tree `work`: its JSON result (`error`/`at` if an import failed)."""
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"modules": EXACT_PATH, "texts": texts or {}}))
    path = [str(work), str(ROOT / "integration"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", HARNESS, str(plan)], capture_output=True,
                       text=True, env=env, cwd=tmp, timeout=500)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def work() -> Path:
    return tree.apply(ROOT, "sglang")


@pytest.fixture(scope="module")
def patched(work, tmp_path_factory) -> dict:
    return cuda_load(work, tmp_path_factory.mktemp("cuda-load"))


def test_exact_path_imports_on_cuda_without_sgl_kernel_or_flashinfer(patched):
    assert "error" not in patched, patched
    assert patched["cuda"] is True  # the harness took SGLang's CUDA branches
    assert patched["unavailable"] == [True, True]  # ... and the guards' missing-package branch
    assert "OnpolicyAttnBackend" in patched["onpolicy_backend"]
    assert patched["qwen3_moe"] == "sglang.srt.models.qwen3_moe"


def test_rms_norm_reaches_onpolicy_under_cuda_dispatch(patched):
    """An RMSNorm made with the switch on runs forward_native (onpolicy's hook) under CUDA's
    dispatch; with the switch off the same call goes to forward_cuda, sgl-kernel's rmsnorm
    (absent here, so it fails): the hook, not the platform, picks the path."""
    assert patched["rms_norm"] == "onpolicy", patched["rms_norm"]
    assert patched["rms_norm_off"] == "TypeError: 'NoneType' object is not callable", patched


def test_control_without_the_guards_fails_at_an_sgl_kernel_import(work, tmp_path):
    """The same tree and harness with only this patch's files at their pre-patch text."""
    names = [p.name for p in load_series(ROOT, "sglang").patches]
    revs = tree.git(work, "rev-list", "--reverse", f"{tree.BASE_TAG}..HEAD").stdout.split()
    rev = revs[names.index(PATCH)]
    files = tree.git(work, "diff", "--name-only", f"{rev}^", rev).stdout.split()
    assert files and all(f.endswith(".py") and not f.endswith("__init__.py") for f in files)
    texts = {
        f.removesuffix(".py").replace("/", "."): (
            str(work / f), tree.git(work, "show", f"{rev}^:{f}").stdout
        )
        for f in files
    }  # fmt: skip
    control = cuda_load(work, tmp_path, texts)
    assert "sgl_kernel" in control.get("error", ""), control
    assert control["at"].removeprefix(f"{work}/").rsplit(":", 1)[0] in files, control
