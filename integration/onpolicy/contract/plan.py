"""The resolved plan for a valid config: engines, per-rank layout, engine arguments, environment.

Trainer ranks follow the run's `ParallelLayout` (megatron-core's "tp-cp-ep-dp-pp" order).
SGLang engine i holds devices [i*tp, (i+1)*tp); inside it, MoE EP rank = tp rank // MoE TP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onpolicy.contract.config import RunConfig
from onpolicy.contract.rules import k_segments, rollout_moe_tp, validate
from onpolicy.contract.schema import QWEN3_MOE_TRUE_ON_POLICY_V1 as V1
from onpolicy.segments import ENV as K_SEGMENTS_ENV
from onpolicy.segments import KSegments


@dataclass(kw_only=True, slots=True)
class Plan:
    """Everything a launcher needs, derived from a config that passed every rule."""

    contract: str
    """The contract id."""
    device: str
    """'cpu' or 'cuda'."""
    backend: str
    """torch.distributed backend: gloo or nccl."""
    training_world: int
    """Trainer ranks."""
    training_dims: dict[str, int | bool]
    """tp, pp, ep, etp, sp, dp and the derived edp."""
    training_ranks: list[dict[str, object]]
    """Per trainer rank: its coordinates (tp, dp, pp, etp, ep, edp), layers and experts."""
    engines: int
    """SGLang engines."""
    gpus_per_engine: int
    """Ranks per engine (SGLang tp_size)."""
    rollout_dims: dict[str, int]
    """tp, ep and the derived MoE TP of one engine."""
    rollout_ranks: list[dict[str, object]]
    """Per engine rank: engine, device, tp, moe_ep, moe_tp and experts."""
    k_segments: KSegments
    """S of each row-parallel matmul, the same on both sides (`contract.k_segments`)."""
    megatron_args: list[str]
    """Megatron command-line arguments for the layout and the exact numerics."""
    sglang_args: dict[str, object]
    """SGLang `Engine(**kwargs)` for one engine."""
    training_env: dict[str, str]
    """Environment of every trainer process (ENV_WHY says why each is set)."""
    rollout_env: dict[str, str]
    """Environment of every engine process."""


ENV_WHY = {
    "ATEN_CPU_CAPABILITY": "torch's CPU vector kernels (exp, log, sqrt) round differently at the "
    "DEFAULT level than at AVX2; one level for every process keeps the CPU ops' bits equal on "
    "every x86-64 host",
    K_SEGMENTS_ENV: "the S equal segments each row-parallel matmul's K is cut into "
    "(contract.k_segments); trainer, engines and reference must all cut it alike, and a "
    "process alone would take its own TP",
}
"""Why each variable of a plan's environment is set. The exact ops fix their own reduction
order (thread count included) and the collectives fix theirs, so nothing else is needed: not
NCCL_ALGO, not OMP_NUM_THREADS. Only the K segments depend on the run: both sides' layouts."""


EXACT_ONLY_ENV = ("ATEN_CPU_CAPABILITY",)
"""Variables only the exact path needs. A process on the stock path (a negative control) runs
torch's own kernels, whose bits need match nothing, and a capability pinned below the host's
can stop them: on an AVX-512 host at AVX2, bf16 SDPA refuses any query of 64 tokens or more
("pack_vnni2 is only supported when avx512 is supported")."""


def stock_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process on the stock path: without the EXACT_ONLY_ENV variables."""
    return {k: v for k, v in env.items() if k not in EXACT_ONLY_ENV}


def _env(cfg: RunConfig) -> dict[str, str]:
    cpu = {"ATEN_CPU_CAPABILITY": "avx2"} if cfg.device == "cpu" else {}
    return cpu | {K_SEGMENTS_ENV: k_segments(cfg).env_value()}


def _megatron_args(cfg: RunConfig) -> list[str]:
    t = cfg.training
    args = [
        "--tensor-model-parallel-size", str(t.tp),
        "--pipeline-model-parallel-size", str(t.pp),
        "--expert-model-parallel-size", str(t.ep),
        "--expert-tensor-parallel-size", str(t.etp),
        "--context-parallel-size", str(t.cp),
    ]  # fmt: skip
    if t.sp:
        args.append("--sequence-parallel")
    args += [
        "--bf16",
        "--transformer-impl", "local",
        "--no-rope-fusion",
        "--no-bias-swiglu-fusion",
        "--no-gradient-accumulation-fusion",
        "--make-vocab-size-divisible-by", "1",
        "--distributed-backend", "nccl" if cfg.device == "cuda" else "gloo",
    ]  # fmt: skip
    return args


def _sglang_args(cfg: RunConfig) -> dict[str, object]:
    r = cfg.rollout
    args: dict[str, object] = {
        "tp_size": r.tp,
        "ep_size": r.ep,
        "enable_dp_attention": False,
        "dtype": cfg.model.dtype,
        "device": cfg.device,
        "enable_deterministic_inference": True,
        "disable_custom_all_reduce": True,
    }
    if cfg.model.hf_path:
        args["model_path"] = cfg.model.hf_path
    return args


def resolve_plan(cfg: RunConfig) -> Plan:
    """Validate `cfg` (raising the failing rule's ContractError) and derive the plan."""
    validate(cfg)
    t, r, m = cfg.training, cfg.rollout, cfg.shape
    moe_tp = rollout_moe_tp(cfg)
    training_ranks = []
    for g in range(t.world):
        layers, experts = t.layers(g, m.num_hidden_layers), t.experts(g, m.num_experts)
        training_ranks.append({"rank": g, **t.coords(g), "layers": (layers.start, layers.stop),
                               "experts": (experts.start, experts.stop)})  # fmt: skip
    per_engine_rank = m.num_experts // r.ep
    rollout_ranks = []
    for e in range(r.engines):
        for j in range(r.tp):
            ep = j // moe_tp
            rollout_ranks.append({
                "engine": e, "device": e * r.tp + j, "tp": j, "moe_ep": ep, "moe_tp": j % moe_tp,
                "experts": (ep * per_engine_rank, (ep + 1) * per_engine_rank),
            })  # fmt: skip
    return Plan(
        contract=V1.name,
        device=cfg.device,
        backend="nccl" if cfg.device == "cuda" else "gloo",
        training_world=t.world,
        training_dims=t.degrees(),
        training_ranks=training_ranks,
        engines=r.engines,
        gpus_per_engine=r.tp,
        rollout_dims={"tp": r.tp, "ep": r.ep, "moe_tp": moe_tp},
        rollout_ranks=rollout_ranks,
        k_segments=k_segments(cfg),
        megatron_args=_megatron_args(cfg),
        sglang_args=_sglang_args(cfg),
        training_env=_env(cfg),
        rollout_env=_env(cfg),
    )


def _dims(d: dict) -> str:
    def one(k: str, v: object) -> str:
        if isinstance(v, bool):
            return k.upper() if v else f"no-{k.upper()}"
        return f"{k.upper()}{v}"

    return " ".join(one(k, v) for k, v in d.items())


def format_plan(cfg: RunConfig, plan: Plan) -> str:
    """The plan as text: summary, two rank tables, arguments and environment."""
    m = cfg.shape
    source = cfg.model.hf_path or f"tiny (seed {cfg.model.seed})"
    out = [
        f"contract  {plan.contract}  (valid)",
        f"model     {source}: {m.num_hidden_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_attention_heads} heads / {m.num_key_value_heads} kv x {m.head_dim}, "
        f"{m.num_experts} experts top-{m.num_experts_per_tok} x {m.moe_intermediate_size}, "
        f"vocab {m.vocab_size}, {cfg.model.dtype}",
        f"device    {plan.device} ({plan.backend})",
        f"training  world {plan.training_world}: {_dims(plan.training_dims)}",
        f"rollout   {plan.engines} engines x {plan.gpus_per_engine} "
        f"{'GPUs' if plan.device == 'cuda' else 'CPU ranks'} per engine: "
        f"{_dims(plan.rollout_dims)}",
        f"segments  attention output K {m.num_attention_heads * m.head_dim}: "
        f"S = {plan.k_segments.attention}; experts' down K {m.moe_intermediate_size}: "
        f"S = {plan.k_segments.experts}",
        "",
        "training ranks",
        "  rank  tp  dp  pp | etp  ep  edp | layers    experts",
    ]
    for x in plan.training_ranks:
        (l0, l1), (e0, e1) = x["layers"], x["experts"]
        out.append(
            f"  {x['rank']:>4}  {x['tp']:>2}  {x['dp']:>2}  {x['pp']:>2} | {x['etp']:>3}  "
            f"{x['ep']:>2}  {x['edp']:>3} | {l0:>3}-{l1 - 1:<4} {e0:>3}-{e1 - 1}"
        )
    out += ["", "rollout ranks", "  engine  device  tp | moe_ep  moe_tp | experts"]
    for x in plan.rollout_ranks:
        e0, e1 = x["experts"]
        out.append(
            f"  {x['engine']:>6}  {x['device']:>6}  {x['tp']:>2} | {x['moe_ep']:>6}  "
            f"{x['moe_tp']:>6} | {e0:>3}-{e1 - 1}"
        )
    sglang = ", ".join(f"{k}={v!r}" for k, v in plan.sglang_args.items())
    out += [
        "",
        f"megatron args  {' '.join(plan.megatron_args)}",
        f"sglang args    Engine({sglang})",
        f"training env   {_env_line(plan.training_env)}",
        f"rollout env    {_env_line(plan.rollout_env)}",
    ]
    for k in sorted({*plan.training_env, *plan.rollout_env}):
        out.append(f"  {k}: {ENV_WHY[k]}")
    return "\n".join(out)


def _env_line(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items()) or "(nothing to set)"


def plan_dict(plan: Plan) -> dict:
    """The plan as plain data (for --json)."""
    return dataclasses.asdict(plan)
