"""What an engine process's environment carries, per device."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from onpolicy.rollout import engine_env
from onpolicy.rollout.engine import MODEL_PACKAGE_ENV

SKIP = "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"


def test_a_cuda_engine_skips_the_sgl_kernel_version_check_and_a_cpu_one_runs_on_cpu(tmp_path):
    cuda, cpu = engine_env(1, tmp_path, "cuda"), engine_env(2, tmp_path, "cpu")
    assert cuda[SKIP] == "1" and "SGLANG_USE_CPU_ENGINE" not in cuda, cuda
    assert SKIP not in cpu and cpu["SGLANG_USE_CPU_ENGINE"] == "1", cpu
    assert cpu["OMP_NUM_THREADS"] == "1" and cpu["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1


def test_sglang_reads_the_variable_before_its_sgl_kernel_assert():
    """The pinned SGLang's CUDA start asserts sglang-kernel's version unless SKIP is set: the
    name must be the one it reads (a renamed variable would let the assert stop the start)."""
    spec = importlib.util.find_spec("sglang.srt.entrypoints.engine")
    text = Path(spec.origin).read_text()
    at = text.index(f'get_bool_env_var("{SKIP}")')
    guarded = text[at : at + 1200]
    assert '"sglang-kernel"' in guarded and "assert_pkg_version(" in guarded, guarded


TREE = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


def test_a_cuda_engine_takes_the_python_radix_tree_core_by_the_name_sglang_reads():
    """A CUDA engine's radix cache runs SGLang's Python TreeCore (the Rust one failed on the GPU
    host); the variable must be the one SGLang's registry reads and "python" a name it has."""
    assert engine_env(1, "/run", "cuda")[TREE] == "python"
    assert TREE not in engine_env(1, "/run", "cpu")
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        registered_tree_core_backends,
    )

    assert getattr(envs, TREE).name == TREE
    assert "python" in registered_tree_core_backends()


_REGISTRY = """
import sys
from sglang.srt.models.registry import ModelRegistry, _ModelRegistry
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
cls, arch = ModelRegistry.resolve_model_cls(["Qwen3MoeForCausalLM"])
assert cls is Qwen3MoeForCausalLM and arch == "Qwen3MoeForCausalLM", (cls, arch)
print(int("sglang.srt.models.llama" in sys.modules), len(ModelRegistry.models))
stock = _ModelRegistry()  # what the registry does without the variable
stock.register("sglang.srt.models")
assert stock.resolve_model_cls(["Qwen3MoeForCausalLM"])[0] is Qwen3MoeForCausalLM
print(int("sglang.srt.models.llama" in sys.modules), len(stock.models))
import sglang.srt.model_executor.model_runner
from sglang.srt.debug_utils.dumper import _MegatronPlugin
before = "megatron.core" in sys.modules
print(int(before), int(_MegatronPlugin()._available and "megatron.core" in sys.modules))
"""


def test_the_registry_resolves_sglangs_qwen3_moe_without_importing_the_other_models(tmp_path):
    """Every engine takes `rollout.models` as SGLang's external model package: SGLang's own
    class, and none of its ~200 default model modules imported (4.7 CPU-s in every scheduler
    process). The control, in the same process: the registry SGLang builds without the
    variable imports them all."""
    import os
    import subprocess
    import sys

    env = engine_env(1, tmp_path, "cpu")
    assert engine_env(1, tmp_path, "cuda")[MODEL_PACKAGE_ENV] == env[MODEL_PACKAGE_ENV]
    p = subprocess.run([sys.executable, "-c", _REGISTRY], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    ours, stock, megatron = (tuple(map(int, ln.split())) for ln in p.stdout.splitlines())
    assert ours == (0, 1), ours
    assert stock[0] == 1 and stock[1] > 100, stock
    # The model runner's import leaves megatron.core out (the series' dumper patch, 4 CPU-s a
    # scheduler); SGLang's Megatron dump plugin still loads it when used.
    assert megatron == (0, 1), megatron
