"""With sgl-kernel and flashinfer installed, the exact path under CUDA dispatch calls onpolicy.

test_sglang_cuda_imports.py loads SGLang's CUDA branches with both packages absent (the H200
test host). Here the same fake CUDA platform (`torch.cuda.is_available`, `torch.version.cuda`,
an H200's device properties) runs with both packages PRESENT as stubs: a meta-path finder
serves `sgl_kernel`, `flashinfer` and every submodule (`sgl_kernel.kvcacheio`,
`flashinfer.norm`, ...) as a package with a real spec, so `import`, `from ... import` and
`importlib.util.find_spec` (SGLang's `is_flashinfer_available`) all see them installed and the
guards of `fix_import_the_cuda_sgl_kernel_ops_only_when_sgl_kernel_is_installed` import the ops.
Every attribute of a stub is a recorder: a call appends `sgl_kernel.<name>` (or
`flashinfer.<path>`) to the call log and returns its first tensor argument (most of these ops
write in place); a CamelCase name is a class (SGLang subclasses `flashinfer`'s
`TorchDistBackend`) whose construction is recorded the same way.

Each hook of the series is then called, on small CPU tensors, on the smallest SGLang object
that holds it, built by SGLang's own constructors under a published config
(`get_context().override_server_args`, SGLang's test entry point, with `rl_on_policy_target`
"onpolicy" for the switch on and unset for the control) and a single-rank parallel context
(ranks 0, groups of one; `get_parallel().override_permanently`, as SGLang's own tests state
ranks without building process groups). The onpolicy function each hook calls is wrapped by a
recorder that logs its qualified name and calls through (the real onpolicy code runs, its
own torch calls not logged); the stock implementations that are not sgl-kernel are logged by
name too (`torch.nn.functional.linear` / `embedding`, `torch.matmul`, SGLang's custom
all-reduce ops, its JIT RoPE / QK-norm kernels and its triton MoE kernels; the ones that
cannot run on CPU are logged and not run). The log of one call is what that call reached.

Switch on: every hook's log is exactly its onpolicy function: no `sgl_kernel.` /
`flashinfer.` entry, no stock kernel. Switch off (the control, same harness): each hook's log
starts with the stock CUDA implementation, which is sgl-kernel (RMSNorm, the QK-norm) or
flashinfer (the sampler's top-k) where SGLang 0.5.23 uses them, otherwise torch or SGLang's
own kernels (linears, lm head, embedding: torch; RoPE: SGLang's JIT
apply_rope_with_cos_sin_cache_inplace; the MoE router: the triton moe_fused_gate).

What is not exercised, and why:
- GroupCoordinator.all_reduce: a coordinator of two ranks is made with `object.__new__` (one
  CPU process cannot build SGLang's CUDA groups); with the switch on the recorder does not
  call through (a tree over two ranks needs the other rank) and returns its input. The
  control passes a `meta` tensor so the stock code takes its device branch, not the CPU
  (gloo / shm) one, and reaches torch.ops.sglang.inplace_all_reduce (logged, not run);
  which CUDA communicator (custom all-reduce, pynccl) that op would use is not exercised.
- Attention: the hook is the registry entry, chosen by attention_backend="onpolicy", not by
  the switch. `ATTENTION_BACKENDS["onpolicy"]` builds OnpolicyAttnBackend from a runner
  namespace (page_size 1, a req-to-token table, a KV pool of plain tensors) and a decode
  reaches onpolicy.kernels.paged_attention alone. The stock CUDA backends (fa3 on an H200:
  sgl_kernel.flash_attn; flashinfer; triton) cannot be built without the ModelRunner of a
  loaded model: the control only shows that fa3's factory builds FlashAttentionBackend and
  fails here at build, with no call logged.
- The MoE control stops after the router: the stock top-k post-processing needs a real CUDA
  device, so the experts' kernels (triton fused_moe, sgl_kernel.moe_align_block_size /
  moe_sum_reduce) are not reached. The routed block's log shows none of them either way.
- The sampler: the switch on samples the full distribution (the only rule the exact path
  accepts) with a seed; the control asks top_k 5 without a seed (stock flashinfer refuses
  seeds), which is flashinfer's top_k_top_p_sampling_from_probs (a full-distribution stock
  sample is torch multinomial).
- SiLU-mul: not routed by the series and not on the exact path: onpolicy's Qwen3-MoE config
  refuses dense layers (mlp_only_layers, decoder_sparse_step), and the experts' SwiGLU runs
  inside the routed sparse block, so no SiluAndMul is called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from onpolicy.upstream import tree
from test_sglang_cuda_imports import FAKE_H200

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]

HARNESS = (
    r"""
import functools, importlib, importlib.abc, importlib.machinery, json, sys, traceback, types
import msgspec
import torch

LOG = []
DEPTH = [0]  # > 0 inside an onpolicy function: its own torch calls are not logged


class Rec:
    # sgl_kernel.<name> / flashinfer.<path>: a call is logged and returns its first tensor.
    def __init__(self, qual):
        self._qual = qual

    def __call__(self, *args, **kwargs):
        LOG.append(self._qual)
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                return a
        return None

    def __getattr__(self, name):
        return stub_attr(self._qual, name)

    def __repr__(self):
        return self._qual


def stub_attr(owner, name):
    if name.startswith("__"):
        raise AttributeError(name)
    qual = f"{owner}.{name}"
    if name[:1].isupper():  # a class: SGLang subclasses some
        def init(self, *args, **kwargs):
            LOG.append(qual)
        return type(name, (), {"__init__": init, "__module__": owner})
    return Rec(qual)


class Stub(types.ModuleType):
    def __getattr__(self, name):
        value = stub_attr(self.__name__, name)
        setattr(self, name, value)
        return value


class Installed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # sgl_kernel, flashinfer and any submodule: packages with a spec (find_spec sees them).
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sgl_kernel", "flashinfer"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return Stub(spec.name)

    def exec_module(self, module):
        module.__version__ = "0.0.0+stub"


sys.meta_path.insert(0, Installed())
"""
    + FAKE_H200
    + r"""

import importlib.util
from sglang.srt.utils import is_cuda, is_flashinfer_available
from sglang.srt.layers import activation, layernorm, sampler as sampler_mod
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe as triton_moe
from sglang.srt.models import qwen3_moe
from sglang.srt.models import utils as model_utils
from sglang.srt.layers.rotary_embedding import base as rope_base
from sglang.kernels.ops.moe import moe_fused_gate
from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
from sglang.srt.distributed import parallel_state
from sglang.srt.runtime_context import get_context, get_parallel
import onpolicy.kernels
import onpolicy.rollout.moe
import onpolicy.rollout.ops
import onpolicy.rollout.sampler

out = {"platform": {
    "cuda": is_cuda(),
    "flashinfer_available": is_flashinfer_available(),
    "sgl_kernel_spec": importlib.util.find_spec("sgl_kernel") is not None,
    "rmsnorm": repr(layernorm.rmsnorm),
    "top_k_renorm_prob": repr(sampler_mod.top_k_renorm_prob),
    "silu_and_mul": repr(activation._sgl_silu_and_mul),
}}


def onpolicy_recorder(mod, name, through=True):
    f = getattr(mod, name)
    qual = f"{mod.__name__}.{name}"

    @functools.wraps(f)
    def rec(*args, **kwargs):
        LOG.append(qual)
        if not through:
            return args[0]
        DEPTH[0] += 1
        try:
            return f(*args, **kwargs)
        finally:
            DEPTH[0] -= 1

    setattr(mod, name, rec)


def stock_recorder(mod, name, qual, through=True, fake=None):
    # A kernel that cannot run here (triton/JIT, a collective) is logged and not run: it
    # returns None (they write in place) or `fake`'s plausible result.
    f = getattr(mod, name)

    @functools.wraps(f)
    def rec(*args, **kwargs):
        if not DEPTH[0]:
            LOG.append(qual)
        if not through:
            return fake(*args, **kwargs) if fake else None
        return f(*args, **kwargs)

    setattr(mod, name, rec)


for n in ("rms_norm", "qk_norm_rope", "linear", "lm_head_logits", "embedding"):
    onpolicy_recorder(onpolicy.rollout.ops, n)
onpolicy_recorder(onpolicy.rollout.ops, "all_reduce", through=False)
onpolicy_recorder(onpolicy.rollout.moe, "sparse_moe_forward")
onpolicy_recorder(onpolicy.rollout.sampler, "create_sampler")
onpolicy_recorder(onpolicy.kernels, "paged_attention")
onpolicy_recorder(onpolicy.rollout.sampler.OnpolicySampler, "forward")
onpolicy.rollout.sampler.OnpolicySampler.forward.__module__ = "onpolicy.rollout.sampler"
import torch.nn.functional as F
stock_recorder(F, "linear", "torch.nn.functional.linear")
stock_recorder(F, "embedding", "torch.nn.functional.embedding")
stock_recorder(torch, "matmul", "torch.matmul")
stock_recorder(sampler_mod, "sampling_from_probs_torch", "torch:sampling_from_probs_torch")
for n in ("inplace_all_reduce", "outplace_all_reduce"):  # SGLang's custom ops
    stock_recorder(parallel_state, n, f"torch.ops.sglang.{n}", through=False)
stock_recorder(qwen3_moe, "fused_qk_norm_rope", "jit:fused_qk_norm_rope", through=False)
stock_recorder(rope_base, "apply_rope_with_cos_sin_cache_inplace",
               "jit:apply_rope_with_cos_sin_cache_inplace", through=False)
stock_recorder(model_utils, "fused_inplace_qknorm", "jit:fused_inplace_qknorm", through=False)
stock_recorder(triton_moe, "invoke_fused_moe_kernel", "triton:fused_moe_kernel", through=False)


def gate(logits, bias, topk, renormalize=True, **kwargs):
    w, ids = torch.softmax(logits.float(), -1).topk(topk)
    return w / w.sum(-1, keepdim=True), ids.int()


stock_recorder(moe_fused_gate, "moe_fused_gate", "triton:moe_fused_gate", through=False,
               fake=gate)


def group(world_size):
    g = object.__new__(parallel_state.GroupCoordinator)
    g.__dict__.update(world_size=world_size, rank=0, ranks=list(range(world_size)),
                      rank_in_group=0, local_rank=0, local_size=world_size, device_group=None,
                      cpu_group=None, unique_name=f"test:{world_size}", hpu_communicator=None,
                      xpu_communicator=None, pynccl_comm=None, ca_comm=None, qr_comm=None,
                      pymscclpp_comm=None, torch_symm_mem_comm=None,
                      _fi_workspace_hint=None, pcie_ipc_comm=None)
    return g


one = group(1)
get_parallel().override_permanently(
    tp_rank=0, pp_rank=0, moe_ep_rank=0, moe_dp_rank=0, moe_tp_rank=0, attn_tp_rank=0,
    attn_cp_rank=0, dcp_rank=0, attn_dcp_rank=0, attn_dp_rank=0, dp_rank=0,
    world_group=one, tp_group=one, pp_group=one, moe_ep_group=one, moe_dp_group=one,
    moe_tp_group=one, attn_tp_group=one, attn_cp_group=one, dcp_group=one,
)

torch.manual_seed(0)
BF = torch.bfloat16
H, HEADS, KV_HEADS, HEAD_DIM, VOCAB, EXPERTS, TOPK, INTER = 64, 2, 1, 64, 128, 4, 2, 32
x = torch.randn(3, H, dtype=BF)
config = types.SimpleNamespace(
    hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    vocab_size=VOCAB, num_experts=EXPERTS, num_experts_per_tok=TOPK,
    moe_intermediate_size=INTER, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=128, rope_scaling=None, tie_word_embeddings=False,
    final_logit_softcapping=None,
)


def filled(module):
    for p in module.parameters():
        p.data = (torch.randn(p.shape) * 0.05).to(BF)
    return module


def norm():
    return filled(layernorm.RMSNorm(H))


def attention():
    a = qwen3_moe.Qwen3MoeAttention(H, HEADS, KV_HEADS, layer_id=0, rope_theta=1e6,
                                    max_position_embeddings=128, head_dim=HEAD_DIM,
                                    config=config)
    return filled(a)


def linear(kind):
    from sglang.srt.layers import linear as L
    make = {
        "replicated": lambda: L.ReplicatedLinear(H, 32, bias=False, params_dtype=BF),
        "qkv": lambda: L.QKVParallelLinear(H, HEAD_DIM, HEADS, KV_HEADS, bias=False,
                                           params_dtype=BF),
        "row": lambda: L.RowParallelLinear(H, 32, bias=False, reduce_results=False,
                                           params_dtype=BF),
    }[kind]
    return lambda: filled(make())


def embedding():
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    return filled(VocabParallelEmbedding(VOCAB, H, params_dtype=BF))


def lm_head():
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    return LogitsProcessor(config), filled(ParallelLMHead(VOCAB, H, params_dtype=BF))


def moe_block():
    return filled(qwen3_moe.Qwen3MoeSparseMoeBlock(0, config))


def sample(s, seeded=True, top_k=-1):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    n = 2
    info = SamplingBatchInfo(
        temperatures=torch.ones(n, 1), top_ps=torch.ones(n), top_ks=torch.full((n,), top_k),
        min_ps=torch.zeros(n), is_all_greedy=False, is_any_greedy=False,
        need_top_p_sampling=False, need_top_k_sampling=top_k > 0, need_min_p_sampling=False,
        vocab_size=VOCAB, sampling_seed=torch.tensor([7, 8]) if seeded else None,
        prompt_lens=torch.tensor([3, 3]),
    )
    logits = LogitsProcessorOutput(next_token_logits=torch.randn(n, VOCAB))
    return s(logits, info, False, [0, 0], [None, None], torch.tensor([3, 3]))


def silu_mul():
    return activation.SiluAndMul()


def attn_backend(name="onpolicy"):
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS,
                                  qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, scaling=0.125,
                                  is_cross_attention=False, sliding_window_size=None)
    kbuf = torch.randn(8, KV_HEADS, HEAD_DIM, dtype=BF)
    vbuf = torch.randn(8, KV_HEADS, HEAD_DIM, dtype=BF)
    pool = types.SimpleNamespace(get_key_buffer=lambda i: kbuf, get_value_buffer=lambda i: vbuf,
                                 set_kv_buffer=lambda *a: None)
    runner = types.SimpleNamespace(
        device="cpu", page_size=1, token_to_kv_pool=pool,
        req_to_token_pool=types.SimpleNamespace(req_to_token=torch.arange(8).view(1, 8)))
    return ATTENTION_BACKENDS[name](runner), layer


def attend(made):
    backend, layer = made
    batch = types.SimpleNamespace(req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([4]),
                                  out_cache_loc=torch.tensor([3]))
    q = torch.randn(1, HEADS * HEAD_DIM, dtype=BF)
    return backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False)


OPS = {  # op: (build the SGLang object, call it)
    "RMSNorm": (norm, lambda n: n(x)),
    "RMSNorm+residual": (norm, lambda n: n(x, x.clone())),
    "qk-norm+RoPE": (attention, lambda a: a.apply_qk_norm_rope(
        torch.randn(3, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=BF), torch.arange(3), None)),
    "ReplicatedLinear": (linear("replicated"), lambda m: m(x)),
    "QKVParallelLinear": (linear("qkv"), lambda m: m(x)),
    "RowParallelLinear": (linear("row"), lambda m: m(x)),
    "lm head": (lm_head, lambda m: m[0]._compute_lm_head(x, m[1])),
    "VocabParallelEmbedding": (embedding, lambda e: e(torch.tensor([1, 5, 9]))),
    "Qwen3MoeSparseMoeBlock": (moe_block, lambda b: b.forward_normal(x)),
    "sampler": (lambda: sampler_mod.create_sampler(), sample),
    "all_reduce": (lambda: group(2), lambda g: g.all_reduce(x.float())),
    "attention backend": (attn_backend, attend),
}
CONTROL_BUILD = {  # the stock CUDA default backend (fa3 on an H200) needs a real ModelRunner
    "attention backend": lambda: attn_backend("fa3"),
}
CONTROL_INPUT = {  # the stock device branch of all_reduce; stock sampling takes no seed
    "all_reduce": lambda g: g.all_reduce(torch.empty(3, H, device="meta")),
    "sampler": lambda s: sample(s, seeded=False, top_k=5),  # (top_k -1: torch multinomial)
}

def where(e):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/sglang/" in f.filename]
    return f"{frames[-1].filename.split('/sglang/')[-1]}:{frames[-1].lineno}" if frames else "?"


for target in ("onpolicy", None):
    side = "on" if target else "off"
    override = get_context().override_server_args(
        rl_on_policy_target=target, dtype="bfloat16", sampling_backend="flashinfer")
    # an fp32 KV pool: RoPE without the fused KV write (which needs a real pool)
    no_pool = types.SimpleNamespace(token_to_kv_pool=types.SimpleNamespace(dtype=torch.float32))
    set_forward_context(ForwardContext(attn_backend=no_pool))
    published = override.install()
    # What an engine's resolution fills in and these layers read: the model dtype, the graphs.
    msgspec.Struct.__setattr__(published, "dtype", "bfloat16")
    get_context().override("harness", cuda_graph_config=default_cuda_graph_config())
    try:
        for op, (make, call) in OPS.items():
            if not target:
                make, call = CONTROL_BUILD.get(op, make), CONTROL_INPUT.get(op, call)
            entry = out.setdefault(op, {})
            LOG.clear()
            try:
                made = make()
            except Exception as e:
                entry[side] = {"built": list(LOG), "log": [],
                               "error": f"build: {type(e).__name__}: {str(e)[:200]}"}
                continue
            built = list(LOG)
            LOG.clear()
            try:
                result = call(made)
                error = None
            except Exception as e:
                error = f"{type(e).__name__}: {str(e)[:300]} at {where(e)}"
            entry[side] = {"built": built, "log": list(LOG), "error": error}
    finally:
        override.restore()
out["stock attention backends"] = {
    name: ATTENTION_BACKENDS[name].__code__.co_names for name in ("fa3", "flashinfer", "triton")
}
print(json.dumps(out))
"""
)


def run_harness(work: Path, tmp: Path) -> dict:
    path = [str(work), str(ROOT / "integration"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", HARNESS], capture_output=True, text=True,
                       env=env, cwd=tmp, timeout=500)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> dict:
    return run_harness(tree.apply(ROOT, "sglang"), tmp_path_factory.mktemp("cuda-dispatch"))


STUBS = ("sgl_kernel.", "flashinfer.")
ONPOLICY = {  # op: the onpolicy function its hook calls
    "RMSNorm": "onpolicy.rollout.ops.rms_norm",
    "RMSNorm+residual": "onpolicy.rollout.ops.rms_norm",
    "qk-norm+RoPE": "onpolicy.rollout.ops.qk_norm_rope",
    "ReplicatedLinear": "onpolicy.rollout.ops.linear",
    "QKVParallelLinear": "onpolicy.rollout.ops.linear",
    "RowParallelLinear": "onpolicy.rollout.ops.linear",
    "lm head": "onpolicy.rollout.ops.lm_head_logits",
    "VocabParallelEmbedding": "onpolicy.rollout.ops.embedding",
    "Qwen3MoeSparseMoeBlock": "onpolicy.rollout.moe.sparse_moe_forward",
    "sampler": "OnpolicySampler.forward",  # built by onpolicy.rollout.sampler.create_sampler
    "all_reduce": "onpolicy.rollout.ops.all_reduce",
    "attention backend": "onpolicy.kernels.paged_attention",
}
STOCK = {  # op: what SGLang's stock CUDA path reached first, in order (sgl_kernel / flashinfer
    # stubs, SGLang's own JIT and triton kernels, torch)
    "RMSNorm": ["sgl_kernel.rmsnorm"],
    "RMSNorm+residual": ["sgl_kernel.fused_add_rmsnorm"],
    "qk-norm+RoPE": ["sgl_kernel.rmsnorm", "sgl_kernel.rmsnorm",
                     "jit:apply_rope_with_cos_sin_cache_inplace"],
    "ReplicatedLinear": ["torch.nn.functional.linear"],
    "QKVParallelLinear": ["torch.nn.functional.linear"],
    "RowParallelLinear": ["torch.nn.functional.linear"],
    "lm head": ["torch.matmul"],
    "VocabParallelEmbedding": ["torch.nn.functional.embedding"],
    "Qwen3MoeSparseMoeBlock": ["torch.nn.functional.linear", "triton:moe_fused_gate"],
    "sampler": ["flashinfer.sampling.top_k_top_p_sampling_from_probs"],
    "all_reduce": ["torch.ops.sglang.inplace_all_reduce"],
}  # fmt: skip


def cell(side: dict) -> str:
    return " ".join(side["built"] + side["log"]) or f"({side['error']})"


def test_table(calls):
    rows = [("op", "switch on (onpolicy)", "switch off (stock CUDA)")]
    rows += [(op, cell(calls[op]["on"]), cell(calls[op]["off"])) for op in ONPOLICY]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    print()
    for r in rows:
        print(f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]}")
    assert set(ONPOLICY) <= set(calls)


def test_stubs_are_taken_as_installed(calls):
    """SGLang's CUDA branches, flashinfer available, the guarded imports bound to the stubs."""
    assert calls["platform"] == {
        "cuda": True, "flashinfer_available": True, "sgl_kernel_spec": True,
        "rmsnorm": "sgl_kernel.rmsnorm", "top_k_renorm_prob": "sgl_kernel.top_k_renorm_prob",
        "silu_and_mul": "sgl_kernel.silu_and_mul",
    }  # fmt: skip


@pytest.mark.parametrize("op", list(ONPOLICY))
def test_switch_on_reaches_onpolicy_and_no_sgl_kernel_or_flashinfer(calls, op):
    on = calls[op]["on"]
    assert on["error"] is None, on
    assert on["log"] == [ONPOLICY[op]], on  # that one function, nothing stock beside it
    assert not [c for c in on["built"] + on["log"] if c.startswith(STUBS)], on
    if op == "sampler":
        assert on["built"] == ["onpolicy.rollout.sampler.create_sampler"], on


@pytest.mark.parametrize("op", list(STOCK))
def test_control_switch_off_reaches_the_stock_cuda_implementation(calls, op):
    off = calls[op]["off"]
    assert off["log"][: len(STOCK[op])] == STOCK[op], off
    assert not [c for c in off["built"] + off["log"] if "onpolicy" in c], off


def test_control_attention_stock_backend_is_another_factory(calls):
    """Not called (see the module docstring): the stock fa3 factory builds
    FlashAttentionBackend, which needs a ModelRunner, and its build fails here before any
    onpolicy or kernel call."""
    off = calls["attention backend"]["off"]
    assert off["error"].startswith("build: ") and off["log"] == [], off
    assert "FlashAttentionBackend" in calls["stock attention backends"]["fa3"]
    assert all("Onpolicy" not in n for names in calls["stock attention backends"].values()
               for n in names)  # fmt: skip
