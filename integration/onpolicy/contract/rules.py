"""The topology rules of qwen3_moe_true_on_policy_v1, checked before anything starts.

Each rule is a function that raises one `ContractError` naming the rule, the values and a fix.
`validate` runs them in order, so a later rule may assume the earlier ones hold (sizes are
positive, the world divides, groups are powers of 2).
"""

from __future__ import annotations

from collections.abc import Callable

from onpolicy.contract.config import RunConfig
from onpolicy.contract.errors import ContractError
from onpolicy.contract.schema import QWEN3_MOE_TRUE_ON_POLICY_V1 as V1
from onpolicy.kernels.rules import is_power_of_2
from onpolicy.segments import KSegments


def training_dp(cfg: RunConfig) -> int:
    """Data-parallel size: the world left after TP, PP and CP."""
    t = cfg.training
    return t.world // (t.tp * t.pp * t.cp)


def dim(cfg: RunConfig, name: str) -> str:
    """Where the user sets model dim `name`: the [model.tiny] table or the checkpoint's
    config.json."""
    if cfg.model.tiny is not None:
        return f"model.tiny.{name}"
    return f"{name} (config.json of model.hf_path)"


def rollout_moe_tp(cfg: RunConfig) -> int:
    """SGLang's MoE TP: the GPUs of an engine over its EP size."""
    return cfg.rollout.tp // cfg.rollout.ep


def _pow2_divisors(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]


def contract_name(cfg: RunConfig) -> None:
    if cfg.contract != V1.name:
        raise ContractError(
            "contract_name",
            f"contract {cfg.contract!r} is unknown; this stack implements {V1.name!r}",
            f"set contract = {V1.name!r}",
        )


def model_family(cfg: RunConfig) -> None:
    if cfg.model.family != V1.model_family:
        raise ContractError(
            "model_family",
            f"model.family is {cfg.model.family!r}; {V1.name} covers {V1.model_family!r} only",
            f"set model.family = {V1.model_family!r}; another family needs its own contract",
        )


def dtype(cfg: RunConfig) -> None:
    if cfg.model.dtype != V1.param_dtype:
        raise ContractError(
            "dtype",
            f"model.dtype is {cfg.model.dtype!r}; {V1.name} fixes {V1.param_dtype!r} "
            f"(accumulation in {V1.accum_dtype})",
            f"set model.dtype = {V1.param_dtype!r}",
        )


def device(cfg: RunConfig) -> None:
    if cfg.device not in ("cpu", "cuda"):
        raise ContractError(
            "device",
            f"device is {cfg.device!r}; the collectives run on 'cpu' (gloo) or 'cuda' (NCCL)",
            "set device = 'cpu' or 'cuda'",
        )


def _lookup(cfg: RunConfig, path: str) -> object:
    obj: object = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def allowed_dims(cfg: RunConfig) -> None:
    for path, value, why in V1.fixed_dims:
        got = _lookup(cfg, path)
        if got != value:
            shown = str(got).lower() if isinstance(got, bool) else got
            want = str(value).lower() if isinstance(value, bool) else value
            raise ContractError(
                "allowed_dims",
                f"{path} = {shown}; {V1.name} pins it to {want}: {why}",
                f"set {path} = {want}",
            )


def positive_sizes(cfg: RunConfig) -> None:
    sizes = {
        "training.world": cfg.training.world, "training.tp": cfg.training.tp,
        "training.pp": cfg.training.pp, "training.ep": cfg.training.ep,
        "training.etp": cfg.training.etp, "training.dp": max(cfg.training.dp, 1),
        "rollout.engines": cfg.rollout.engines, "rollout.tp": cfg.rollout.tp,
        "rollout.ep": cfg.rollout.ep,
    }  # fmt: skip
    for name, v in sizes.items():
        if v < 1:
            raise ContractError("positive_sizes", f"{name} = {v}", f"set {name} to at least 1")


def world_layout(cfg: RunConfig) -> None:
    t = cfg.training
    tpc = t.tp * t.pp * t.cp
    if t.world % tpc:
        raise ContractError(
            "world_layout",
            f"training.world = {t.world} is not a multiple of tp x pp x cp = "
            f"{t.tp} x {t.pp} x {t.cp} = {tpc}",
            f"make training.world a multiple of {tpc}, or shrink tp/pp",
        )
    if t.dp and t.dp != t.world // tpc:
        raise ContractError(
            "world_layout",
            f"training.dp = {t.dp} but world / (tp x pp x cp) = {t.world} / {tpc} = "
            f"{t.world // tpc}",
            f"set training.dp = {t.world // tpc} or drop it (0 derives it)",
        )


def power_of_2_groups(cfg: RunConfig) -> None:
    sizes = {
        "training.tp": cfg.training.tp, "training.pp": cfg.training.pp,
        "training.ep": cfg.training.ep, "training.etp": cfg.training.etp,
        "training.dp": training_dp(cfg), "rollout.tp": cfg.rollout.tp,
        "rollout.ep": cfg.rollout.ep,
    }  # fmt: skip
    assert set(sizes) == set(V1.power_of_2_groups)
    for name, v in sizes.items():
        if not is_power_of_2(v):
            lo, hi = 1 << (v.bit_length() - 1), 1 << v.bit_length()
            fix = f"set {name} to {lo} or {hi}"
            if name == "training.dp":
                t = cfg.training
                fix = (
                    f"set training.world to {lo * t.world // v} or {hi * t.world // v} "
                    "(DP = world / (tp x pp x cp) must be a power of 2)"
                )
            raise ContractError(
                "power_of_2_groups",
                f"{name} = {v} is not a power of 2; the fixed pairwise tree equals the "
                "unsharded sum only when every shard is an aligned power-of-2 subtree",
                fix,
            )


def sp_required(cfg: RunConfig) -> None:
    t = cfg.training
    if t.tp > 1 and not t.sp:
        raise ContractError(
            "sp_required",
            f"training.tp = {t.tp} with a MoE model and training.sp = false; Megatron's MoE "
            "layers need sequence parallel when TP > 1, and the exact TP path is the SP "
            "reduce-scatter",
            "set training.sp = true (or training.tp = 1)",
        )


def ep_divides_dp(cfg: RunConfig) -> None:
    ep, dp = cfg.training.ep, training_dp(cfg)
    if dp % ep:
        raise ContractError(
            "ep_divides_dp",
            f"training.ep = {ep} does not divide training DP = world / (tp x pp x cp) = {dp}",
            f"set training.ep to a divisor of {dp}, or raise training.world",
        )


def rollout_ep_divides_tp(cfg: RunConfig) -> None:
    r = cfg.rollout
    if r.tp % r.ep:
        raise ContractError(
            "rollout_ep_divides_tp",
            f"rollout.ep = {r.ep} does not divide the GPUs per engine rollout.tp = {r.tp}",
            "set rollout.ep to a divisor of rollout.tp",
        )


def colocated_gpus(cfg: RunConfig) -> None:
    r, world = cfg.rollout, cfg.training.world
    if r.colocate and r.engines * r.tp != world:
        raise ContractError(
            "colocated_gpus",
            f"rollout.engines x rollout.tp = {r.engines} x {r.tp} = {r.engines * r.tp} but the "
            f"colocated trainer has training.world = {world}",
            f"set rollout.engines = {max(world // r.tp, 1)} for rollout.tp = {r.tp}, "
            "or rollout.colocate = false",
        )


def pp_divides_layers(cfg: RunConfig) -> None:
    n, pp = cfg.shape.num_hidden_layers, cfg.training.pp
    if n % pp:
        name = dim(cfg, "num_hidden_layers")
        raise ContractError(
            "pp_divides_layers",
            f"{name} = {n} does not split into training.pp = {pp} equal stages",
            f"set training.pp to one of {_pow2_divisors(n)}, or change the model",
        )


def _shard(rule: str, cfg: RunConfig, field: str, shards: dict[str, int]) -> None:
    value, name_ = getattr(cfg.shape, field), dim(cfg, field)
    for name, s in shards.items():
        if value % s:
            raise ContractError(
                rule,
                f"{name_} = {value} does not divide over {name} = {s}",
                f"set {name} to one of {_pow2_divisors(value)} (the power-of-2 divisors of "
                f"{value}), or change the model",
            )


def shard_heads(cfg: RunConfig) -> None:
    shards = {"training.tp": cfg.training.tp, "rollout.tp": cfg.rollout.tp}
    _shard("shard_heads", cfg, "num_attention_heads", shards)


def shard_kv_heads(cfg: RunConfig) -> None:
    kv, rtp = cfg.shape.num_key_value_heads, cfg.rollout.tp
    _shard("shard_kv_heads", cfg, "num_key_value_heads", {"training.tp": cfg.training.tp})
    if kv % rtp and rtp % kv:  # SGLang replicates KV heads when tp is a multiple of them
        raise ContractError(
            "shard_kv_heads",
            f"{dim(cfg, 'num_key_value_heads')} = {kv} and rollout.tp = {rtp}: neither divides "
            "the other, so SGLang can neither split nor replicate the KV heads",
            f"choose rollout.tp dividing {kv} or a multiple of it",
        )


def shard_experts(cfg: RunConfig) -> None:
    shards = {"training.ep": cfg.training.ep, "rollout.ep": cfg.rollout.ep}
    _shard("shard_experts", cfg, "num_experts", shards)


def shard_moe_intermediate(cfg: RunConfig) -> None:
    shards = {"training.etp": cfg.training.etp, "rollout MoE TP": rollout_moe_tp(cfg)}
    _shard("shard_moe_intermediate", cfg, "moe_intermediate_size", shards)


def shard_vocab(cfg: RunConfig) -> None:
    shards = {"training.tp": cfg.training.tp, "rollout.tp": cfg.rollout.tp}
    _shard("shard_vocab", cfg, "vocab_size", shards)


def vocab_parallel_exact(cfg: RunConfig) -> None:
    """The vocab-parallel log-softmax equals the full one only where every TP shard holds whole
    segments of its sum tree (kernels/rules.py)."""
    from onpolicy.kernels.rules import VOCAB_SEGMENTS, vocab_parallel_exact, vocab_segments

    v = cfg.shape.vocab_size
    segs = vocab_segments(v)
    for name, tp in (("training.tp", cfg.training.tp), ("rollout.tp", cfg.rollout.tp)):
        if not vocab_parallel_exact(v, tp):
            ok = [t for t in (1, 2, 4, 8) if vocab_parallel_exact(v, t)]
            raise ContractError(
                "vocab_parallel_exact",
                f"{name} = {tp} splits the LM head's {dim(cfg, 'vocab_size')} = {v} into {tp} "
                f"shards, but its log-softmax sum is a tree over {segs} equal segments (at most "
                f"{VOCAB_SEGMENTS}), so a shard would not hold whole segments and the "
                "vocab-parallel log-probs would differ from the full ones",
                f"set {name} to one of {ok}",
            )


def k_segments(cfg: RunConfig) -> KSegments:
    """S of each row-parallel matmul of the run (`kernels.rules.k_segments`): the largest TP
    of either side that cuts its K and divides it. Every process of the run cuts that K into
    these S segments (the plan hands them over in ONPOLICY_K_SEGMENTS, `onpolicy.segments`)."""
    from onpolicy.kernels.rules import k_segments as segments_of

    m = cfg.shape
    return KSegments(
        attention=segments_of(m.num_attention_heads * m.head_dim,
                              (cfg.training.tp, cfg.rollout.tp)),
        experts=segments_of(m.moe_intermediate_size, (cfg.training.etp, rollout_moe_tp(cfg))),
    )  # fmt: skip


def _segments_exact(rule: str, what: str, k: int, total: int, sides: dict[str, int],
                    settable: str) -> None:  # fmt: skip
    from onpolicy.kernels.rules import row_parallel_exact

    for name, tp in sides.items():
        if not row_parallel_exact(k, tp, total):
            cut = " and ".join(f"{n} = {t}" for n, t in sides.items())
            raise ContractError(
                rule,
                f"{name} = {tp} cuts {what} = {k} into {tp} shards, but the run cuts that K "
                f"into S = {total} segments (the largest of {cut} that divides it): a shard "
                "would not hold an aligned power-of-2 count of whole segments, so its sum "
                "would differ from the other side's",
                f"set {settable} to powers of 2 that divide {k}: {_pow2_divisors(k)}",
            )


def attention_k_segments(cfg: RunConfig) -> None:
    """Both sides cut the attention output projection's K into the run's S segments, each TP
    rank holding an aligned power-of-2 count of them, so both compute the same segment tree.
    The shard rules before it make this hold (power-of-2 TPs that divide K); it states why."""
    m = cfg.shape
    k = m.num_attention_heads * m.head_dim
    _segments_exact(
        "attention_k_segments",
        f"the attention output projection's K = heads x head_dim = {m.num_attention_heads} x "
        f"{m.head_dim}", k, k_segments(cfg).attention,
        {"training.tp": cfg.training.tp, "rollout.tp": cfg.rollout.tp},
        "training.tp and rollout.tp",
    )  # fmt: skip


SGLANG_CPU_MOE_PADDING = 32
"""SGLang's CPU model runner pads moe_intermediate_size to a multiple of rollout.tp x this
(`adjust_config_with_unaligned_cpu_tp`) and cuts the padded K over MoE TP."""


def expert_k_segments(cfg: RunConfig) -> None:
    """Megatron's ETP and SGLang's MoE TP cut the experts' down-projection K into the run's S
    segments, each rank an aligned power-of-2 count of them (see `attention_k_segments`). On
    CPU SGLang cuts a zero-padded K: the same tree only where K is a power of 2 (the zeros
    fill whole aligned subtrees of the block tree, which is then the segment tree)."""
    r, k = cfg.rollout, cfg.shape.moe_intermediate_size
    unit = r.tp * SGLANG_CPU_MOE_PADDING
    padded = -(-k // unit) * unit
    if cfg.device == "cpu" and padded != k and not is_power_of_2(k):
        raise ContractError(
            "expert_k_segments",
            f"SGLang's CPU model runner pads {dim(cfg, 'moe_intermediate_size')} = {k} to "
            f"{padded} (a multiple of rollout.tp x {SGLANG_CPU_MOE_PADDING} = {unit}) and cuts "
            "the padded K over MoE TP, so its shards are not the run's equal segments of the "
            "real K",
            f"use a moe_intermediate_size that is a power of 2 or a multiple of {unit}, or "
            "rollout.tp = 1",
        )
    _segments_exact(
        "expert_k_segments",
        f"the experts' down-projection K = {dim(cfg, 'moe_intermediate_size')}",
        cfg.shape.moe_intermediate_size, k_segments(cfg).experts,
        {"training.etp": cfg.training.etp,
         f"rollout MoE TP = rollout.tp / rollout.ep = {r.tp} / {r.ep}": rollout_moe_tp(cfg)},
        "training.etp and rollout.tp / rollout.ep",
    )  # fmt: skip


RULES: dict[str, Callable[[RunConfig], None]] = {
    f.__name__: f
    for f in (
        contract_name, model_family, dtype, device, allowed_dims, positive_sizes, world_layout,
        power_of_2_groups, sp_required, ep_divides_dp, rollout_ep_divides_tp,
        colocated_gpus, pp_divides_layers, shard_heads,
        shard_kv_heads, shard_experts, shard_moe_intermediate, shard_vocab, vocab_parallel_exact,
        attention_k_segments, expert_k_segments,
    )
}  # fmt: skip
"""Every rule, in the order `validate` checks them; the key is the rule name errors carry."""


def validate(cfg: RunConfig) -> None:
    """Raise the first failing rule's `ContractError`; return None when the layout is valid."""
    for rule in RULES.values():
        rule(cfg)
