"""The resolved plan for a valid config: engines, per-rank layout, engine arguments, environment.

Rank order follows Megatron-core's default "tp-cp-ep-dp-pp" (TP fastest). The dense grid is
tp, dp, pp; the expert grid over the same ranks is etp, ep, edp, pp. SGLang engine i holds
devices [i*tp, (i+1)*tp); inside it, MoE EP rank = tp rank // MoE TP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onpolicy.contract.config import RunConfig
from onpolicy.contract.rules import expert_dp, rollout_moe_tp, training_dp, validate
from onpolicy.contract.schema import QWEN3_MOE_TRUE_ON_POLICY_V1 as V1


@dataclass(kw_only=True, slots=True)
class TrainingRank:
    """One Megatron rank's coordinates and what it holds."""

    rank: int
    """Global rank (device index when colocated)."""
    tp: int
    """Rank in its TP (and SP) group."""
    dp: int
    """Rank in its DP group."""
    pp: int
    """Pipeline stage."""
    etp: int
    """Rank in its expert-TP group."""
    ep: int
    """Rank in its EP group."""
    edp: int
    """Rank in its expert-DP group."""
    layers: tuple[int, int]
    """Global decoder layers [start, stop) of its stage."""
    experts: tuple[int, int]
    """Global expert ids [start, stop) it owns."""


@dataclass(kw_only=True, slots=True)
class RolloutRank:
    """One SGLang rank's coordinates and what it holds."""

    engine: int
    """Engine index."""
    device: int
    """Device index on the host (colocated: the same index as the trainer rank)."""
    tp: int
    """Rank in the engine's TP group."""
    moe_ep: int
    """Rank in the engine's MoE EP group."""
    moe_tp: int
    """Rank in the engine's MoE TP group."""
    experts: tuple[int, int]
    """Global expert ids [start, stop) it owns."""


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
    training_ranks: list[TrainingRank]
    """Per-rank Megatron layout."""
    engines: int
    """SGLang engines."""
    gpus_per_engine: int
    """Ranks per engine (SGLang tp_size)."""
    rollout_dims: dict[str, int]
    """tp, ep and the derived MoE TP of one engine."""
    rollout_ranks: list[RolloutRank]
    """Per-rank SGLang layout."""
    megatron_args: list[str]
    """Megatron command-line arguments for the layout and the exact numerics."""
    sglang_args: dict[str, object]
    """SGLang `Engine(**kwargs)` for one engine."""
    training_env: dict[str, str]
    """Environment of every trainer process."""
    rollout_env: dict[str, str]
    """Environment of every engine process."""


def _env(cfg: RunConfig) -> dict[str, str]:
    if cfg.device == "cuda":  # what still reduces through NCCL (gradients) stays fixed-order
        return {
            "NCCL_ALGO": "Ring",
            "NCCL_NVLS_ENABLE": "0",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        }
    return {"OMP_NUM_THREADS": "1"}


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
    t, r, m = cfg.training, cfg.rollout, cfg.model
    dp, edp, moe_tp = training_dp(cfg), expert_dp(cfg), rollout_moe_tp(cfg)
    per_stage, train_e, roll_e = m.num_layers // t.pp, m.num_experts // t.ep, m.num_experts // r.ep
    training_ranks = []
    for g in range(t.world):
        ep = (g // t.etp) % t.ep
        pp = g // (t.tp * t.cp * dp)
        training_ranks.append(
            TrainingRank(
                rank=g,
                tp=g % t.tp,
                dp=(g // (t.tp * t.cp)) % dp,
                pp=pp,
                etp=g % t.etp,
                ep=ep,
                edp=(g // (t.etp * t.ep)) % edp,
                layers=(pp * per_stage, (pp + 1) * per_stage),
                experts=(ep * train_e, (ep + 1) * train_e),
            )
        )
    rollout_ranks = []
    for e in range(r.engines):
        for j in range(r.tp):
            ep = j // moe_tp
            rollout_ranks.append(
                RolloutRank(
                    engine=e,
                    device=e * r.tp + j,
                    tp=j,
                    moe_ep=ep,
                    moe_tp=j % moe_tp,
                    experts=(ep * roll_e, (ep + 1) * roll_e),
                )
            )
    return Plan(
        contract=V1.name,
        device=cfg.device,
        backend="nccl" if cfg.device == "cuda" else "gloo",
        training_world=t.world,
        training_dims={
            "tp": t.tp,
            "pp": t.pp,
            "ep": t.ep,
            "etp": t.etp,
            "sp": t.sp,
            "dp": dp,
            "edp": edp,
        },
        training_ranks=training_ranks,
        engines=r.engines,
        gpus_per_engine=r.tp,
        rollout_dims={"tp": r.tp, "ep": r.ep, "moe_tp": moe_tp},
        rollout_ranks=rollout_ranks,
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
    m = cfg.model
    out = [
        f"contract  {plan.contract}  (valid)",
        f"model     {m.hf_path or 'tiny (seeded)'}: {m.num_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_attention_heads} heads / {m.num_kv_heads} kv x {m.head_dim}, "
        f"{m.num_experts} experts top-{m.top_k} x {m.moe_intermediate_size}, vocab "
        f"{m.vocab_size}, {m.dtype}",
        f"device    {plan.device} ({plan.backend})",
        f"training  world {plan.training_world}: {_dims(plan.training_dims)}",
        f"rollout   {plan.engines} engines x {plan.gpus_per_engine} "
        f"{'GPUs' if plan.device == 'cuda' else 'CPU ranks'} per engine: "
        f"{_dims(plan.rollout_dims)}",
        "",
        "training ranks",
        "  rank  tp  dp  pp | etp  ep  edp | layers    experts",
    ]
    for x in plan.training_ranks:
        out.append(
            f"  {x.rank:>4}  {x.tp:>2}  {x.dp:>2}  {x.pp:>2} | {x.etp:>3}  {x.ep:>2}  {x.edp:>3} "
            f"| {x.layers[0]:>3}-{x.layers[1] - 1:<4} {x.experts[0]:>3}-{x.experts[1] - 1}"
        )
    out += ["", "rollout ranks", "  engine  device  tp | moe_ep  moe_tp | experts"]
    for x in plan.rollout_ranks:
        out.append(
            f"  {x.engine:>6}  {x.device:>6}  {x.tp:>2} | {x.moe_ep:>6}  {x.moe_tp:>6} "
            f"| {x.experts[0]:>3}-{x.experts[1] - 1}"
        )
    sglang = ", ".join(f"{k}={v!r}" for k, v in plan.sglang_args.items())
    out += [
        "",
        f"megatron args  {' '.join(plan.megatron_args)}",
        f"sglang args    Engine({sglang})",
        f"training env   {' '.join(f'{k}={v}' for k, v in plan.training_env.items())}",
        f"rollout env    {' '.join(f'{k}={v}' for k, v in plan.rollout_env.items())}",
    ]
    return "\n".join(out)


def plan_dict(plan: Plan) -> dict:
    """The plan as plain data (for --json)."""
    return dataclasses.asdict(plan)
