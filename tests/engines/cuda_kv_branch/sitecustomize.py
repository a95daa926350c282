"""Makes SGLang's Qwen3-MoE helpers take their CUDA branch on this CPU machine.

A process whose PYTHONPATH holds this folder imports this file at start (`site`), as every
scheduler process of an engine does (SGLang spawns them). When `sglang.srt.models.utils` loads,
its `_is_cuda` is set True, so `enable_fused_set_kv_buffer` answers as on a CUDA host: with a
bf16 KV pool it would leave the KV-cache write to a fused RoPE kernel. The exact path must write
the cache itself anyway (on an H100 it did not, and every log-prob was another model's). Each
process that took the branch appends its pid to $ONPOLICY_CUDA_KV_BRANCH_LOG.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "sglang.srt.models.utils"


class _CudaBranch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # the real finder locates the module
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._is_cuda = True
            with open(os.environ["ONPOLICY_CUDA_KV_BRANCH_LOG"], "a") as f:
                f.write(f"{os.getpid()}\n")

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CudaBranch())
