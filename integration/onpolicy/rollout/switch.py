"""The switch `rl_on_policy_target="onpolicy"`: which settings keep SGLang on the exact path.

`check(args)` runs while SGLang resolves its ServerArgs (the patched deterministic-inference
hook calls it in place of forcing SGLang's own deterministic mode). It raises one
`ContractError` naming the first setting that would leave the exact path, so the engine refuses
to start instead of returning log-probs that differ from the reference.
"""

from __future__ import annotations

from typing import Any

from onpolicy.contract.errors import ContractError
from onpolicy.contract.rules import SGLANG_CPU_MOE_PADDING as CPU_MOE_PADDING
from onpolicy.kernels.rules import is_power_of_2
from onpolicy.segments import ENV, KSegments

TARGET = "onpolicy"
"""The value of SGLang's `rl_on_policy_target` that turns the exact path on."""

ATTENTION_BACKEND = "onpolicy"
"""The attention backend the exact path registers (prefill, extend and decode)."""

DTYPES = ("bfloat16", "float32")
"""Model dtypes the exact path serves: the contract dtype (bf16) and fp32."""


def _refuse(rule: str, problem: str, fix: str) -> None:
    raise ContractError(rule, f"rl_on_policy_target={TARGET!r}: {problem}", fix)


def _check_backends(args: Any) -> None:
    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        got = getattr(args, name, None)
        if name == "attention_backend" and got != ATTENTION_BACKEND:
            _refuse("rollout_attention_backend",
                    f"attention_backend is {got!r}; only the {ATTENTION_BACKEND!r} backend runs "
                    "prefill, chunked prefill and decode through onpolicy.kernels",
                    f"pass attention_backend={ATTENTION_BACKEND!r}")  # fmt: skip
        if name != "attention_backend" and got not in (None, ATTENTION_BACKEND):
            _refuse("rollout_attention_backend",
                    f"{name} is {got!r}; a second backend would serve part of the batches "
                    "with other arithmetic",
                    f"leave {name} unset or pass {ATTENTION_BACKEND!r}")  # fmt: skip


def graph_backends(args: Any) -> dict[str, str]:
    """The CUDA-graph backend SGLang will resolve for each phase ("decode", "prefill"), by its own
    precedence (`arg_groups.cuda_graph_hook.parse_cuda_graph_config`): the legacy global switch,
    the per-phase off-switches, the per-phase backends, then an explicit `cuda_graph_config`."""
    device = getattr(args, "device", None) or "cpu"
    got = {"decode": "full", "prefill": "breakable" if device == "cuda" else "disabled"}
    if getattr(args, "disable_cuda_graph", False):
        got = dict.fromkeys(got, "disabled")
    for phase in got:
        if getattr(args, f"disable_{phase}_cuda_graph", False):
            got[phase] = "disabled"
        chosen = getattr(args, f"cuda_graph_backend_{phase}", None)
        if chosen is not None:
            got[phase] = chosen
    explicit = getattr(args, "cuda_graph_config", None)
    if explicit is not None and not isinstance(explicit, dict):
        explicit = explicit.to_dict()
    for phase, settings in (explicit or {}).items():
        if isinstance(settings, dict) and "backend" in settings:
            got[phase] = settings["backend"]
    return got


def _check_graphs(args: Any) -> None:
    # A decode graph replays the eager step's kernels on the captured buffers: every exact
    # kernel reads its lengths and tables from the device, so a replay gives the eager bits
    # (docs/exactness.md, "CUDA graphs"). Prefill graphs capture per-token-bucket metadata the
    # onpolicy backend does not build, and a CPU engine has no CUDA graphs at all.
    device = getattr(args, "device", None) or "cpu"
    got = graph_backends(args)
    allowed = {"decode": ("full", "disabled") if device == "cuda" else ("disabled",),
               "prefill": ("disabled",)}  # fmt: skip
    for phase, backend in got.items():
        if backend not in allowed[phase]:
            fix = ("pass disable_cuda_graph=True" if device != "cuda"
                   else f"pass disable_{phase}_cuda_graph=True")  # fmt: skip
            _refuse("rollout_cuda_graphs",
                    f"the {phase} CUDA-graph backend would be {backend!r} on {device}; the exact "
                    f"path captures decode batches only, with the 'full' backend, on CUDA",
                    fix)  # fmt: skip


def _check_features(args: Any) -> None:
    spec = getattr(args, "speculative_algorithm", None)
    if spec is not None:
        _refuse("rollout_no_speculative_decoding",
                f"speculative_algorithm is {spec!r}; draft-and-verify decoding scores tokens "
                "with batches the exact path does not cover",
                "leave speculative_algorithm unset")  # fmt: skip
    _check_graphs(args)
    if getattr(args, "enable_torch_compile", False):
        _refuse("rollout_no_torch_compile",
                "enable_torch_compile would let inductor fuse and reorder the exact ops",
                "pass enable_torch_compile=False")  # fmt: skip
    for name in ("enable_dp_attention", "enable_two_batch_overlap"):
        if getattr(args, name, False):
            _refuse("rollout_layout", f"{name} is on; it splits batches across ranks",
                    f"pass {name}=False")  # fmt: skip
    pp = getattr(args, "pp_size", 1) or 1
    if pp != 1:
        _refuse("rollout_layout", f"pp_size is {pp}; the exact path serves TP/EP engines only",
                "pass pp_size=1")  # fmt: skip
    a2a = getattr(args, "moe_a2a_backend", "none") or "none"
    if a2a != "none":
        _refuse("rollout_layout",
                f"moe_a2a_backend is {a2a!r}; the exact EP combine runs over the TP group",
                "pass moe_a2a_backend='none'")  # fmt: skip
    dtype = getattr(args, "dtype", None)
    if dtype not in DTYPES:
        _refuse("dtype", f"dtype is {dtype!r}; the model dtype must be named explicitly",
                f"pass dtype as one of {DTYPES}")  # fmt: skip
    kv = getattr(args, "kv_cache_dtype", "auto")
    if kv not in ("auto", dtype):
        _refuse("dtype", f"kv_cache_dtype is {kv!r}, not the model dtype {dtype!r}",
                "pass kv_cache_dtype='auto'")  # fmt: skip


def check_tp(tp: int, ep: int, heads: int, head_dim: int, moe_intermediate: int,
             segments: KSegments | None = None, device: str = "cpu") -> None:  # fmt: skip
    """Refuse a TP/EP whose row-parallel sums would not be the run's segment trees.

    The attention output projection is cut over TP along K = heads x head_dim, the experts'
    down projection over MoE TP = tp / ep along K = moe_intermediate. Each K is cut into the
    run's S segments (`segments`, ONPOLICY_K_SEGMENTS; None: S = this engine's own TP), and
    each rank must hold an aligned power-of-2 count of them (`kernels.rules.row_parallel_exact`).
    Embedding, the QKV and gate/up projections and the vocab-parallel LM head are cut along N:
    exact at any TP. On CPU SGLang cuts a zero-padded expert K
    (`contract.rules.SGLANG_CPU_MOE_PADDING`): the run's segment tree only where K is a power
    of 2 (see below).
    """
    from onpolicy.kernels.rules import row_parallel_exact

    if not (is_power_of_2(tp) and is_power_of_2(ep)):
        _refuse("power_of_2_groups", f"tp_size = {tp}, ep_size = {ep}",
                "use power-of-2 tp_size and ep_size")  # fmt: skip
    if tp % ep:
        _refuse("rollout_ep_divides_tp", f"ep_size = {ep} does not divide tp_size = {tp}",
                "set ep_size to a divisor of tp_size")  # fmt: skip
    cuts = (
        ("attention_k_segments", "a TP", "the attention projection's K = heads x head_dim",
         heads * head_dim, tp, None if segments is None else segments.attention),
        ("expert_k_segments", "a MoE TP (tp_size / ep_size)",
         "the experts' down projection K = moe_intermediate_size", moe_intermediate, tp // ep,
         None if segments is None else segments.experts),
    )  # fmt: skip
    unit = tp * CPU_MOE_PADDING
    padded = -(-moe_intermediate // unit) * unit
    # A power-of-2 K pads to a power of 2 with the zeros in whole aligned subtrees, and with K
    # and S powers of 2 the CPU segment tree is the block tree: the padded cut sums that tree.
    # Any other padded K puts the shard boundaries elsewhere than the run's segments.
    if device == "cpu" and padded != moe_intermediate and not is_power_of_2(moe_intermediate):
        _refuse("expert_k_segments",
                f"SGLang's CPU model runner pads moe_intermediate_size = {moe_intermediate} to "
                f"{padded} (a multiple of tp_size x {CPU_MOE_PADDING}) and cuts the padded K "
                "over MoE TP, so its shards are not the run's equal segments of the real K",
                f"use a moe_intermediate_size that is a power of 2 or a multiple of {unit}, or "
                "tp_size 1")  # fmt: skip
    for rule, cut, what, k, t, s in cuts:
        s = t if s is None else s
        if not row_parallel_exact(k, t, s):
            given = (f" (its own TP: {ENV} is not set)" if segments is None
                     else f" ({ENV}={segments.env_value()})")  # fmt: skip
            _refuse(rule,
                    f"{cut} of {t} cuts {what} = {k} into {t} shards, but the run cuts it into "
                    f"S = {s} segments{given}: a shard would not hold an aligned power-of-2 "
                    "count of whole segments, so the engine's sums would differ from the "
                    "trainer's and the reference model's",
                    f"start the engine at the run's layout with the run's {ENV} (the "
                    "contract's plan), where the TP divides S")  # fmt: skip


def check(args: Any) -> None:
    """Refuse any setting that would leave the exact path; `args` is SGLang's resolving view."""
    _check_backends(args)
    _check_features(args)
    from onpolicy import segments
    from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig

    cfg = Qwen3MoeConfig.from_hf(args.model_path)
    device = getattr(args, "device", None) or "cpu"
    check_tp(args.tp_size, args.ep_size or 1, cfg.num_attention_heads, cfg.head_dim,
             cfg.moe_intermediate_size, segments.current(), device)  # fmt: skip
