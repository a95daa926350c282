"""HF Qwen3-MoE weights <-> megatron-core GPTModel state dicts (the local/exact layer names).

Every Megatron tensor is built from its HF tensors as the global (unsharded) tensor first,
then sliced for this rank: TP/ETP along the dim the layer is split on, PP by contiguous layer
stages, EP by contiguous expert ranges. The slicing follows megatron-core's own CPU init
(`_initialize_affine_weight_cpu`): contiguous chunks, except fc1, whose [gate; up] halves are
chunked separately (stride 2) so that every rank holds [gate_r; up_r].

The way back (`megatron_to_hf`, and `hf_tensors_of` per Megatron tensor, which weight sync
uses) takes *global* tensors: a world-1 state dict, or shards already gathered over TP/ETP.
Both directions only copy, split and concatenate, so a round trip is bit-identical.
"""

from __future__ import annotations

import torch

from onpolicy.layout import ParallelLayout
from onpolicy.models.hf_layout import check_hf_weights, hf_tensor_shapes
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


def _chunk(t: torch.Tensor, n: int, i: int, dim: int, what: str) -> torch.Tensor:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} does not split into {n} shards")
    return t.chunk(n, dim=dim)[i].contiguous()


def qkv_weight(cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """linear_qkv rows per KV group g: [q heads of g | k_g | v_g]."""
    groups, d, h = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    q = sd[f"{prefix}.q_proj.weight"].view(groups, -1, d, h)
    k = sd[f"{prefix}.k_proj.weight"].view(groups, 1, d, h)
    v = sd[f"{prefix}.v_proj.weight"].view(groups, 1, d, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def hf_to_megatron(
    cfg: Qwen3MoeConfig,
    sd: dict[str, torch.Tensor],
    layout: ParallelLayout,
    rank: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Global rank `rank`'s GPTModel state dict from HF config + weights, at `layout`."""
    n_layers, n_experts = cfg.num_hidden_layers, cfg.num_experts
    if n_layers % layout.pp or n_experts % layout.ep:
        raise ValueError(
            f"layout does not divide the model: {n_layers} layers over PP={layout.pp}, "
            f"{n_experts} experts over EP={layout.ep}"
        )
    if cfg.tie_word_embeddings:
        raise ValueError("HF checkpoint ties lm_head to the embedding; Qwen3-MoE does not, and "
                         "this loader maps them as separate tensors")  # fmt: skip
    check_hf_weights(cfg, sd)
    tp_rank, etp_rank, pp_rank = layout.tp_rank(rank), layout.etp_rank(rank), layout.pp_rank(rank)
    tp = lambda t, dim, what: _chunk(t, layout.tp, tp_rank, dim, what)  # noqa: E731
    etp = lambda t, dim, what: _chunk(t, layout.etp, etp_rank, dim, what)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = tp(sd["model.embed_tokens.weight"], 0, "embed")
    experts = layout.experts(rank, n_experts)
    for local, g in enumerate(layout.layers(rank, n_layers)):
        src, dst = f"model.layers.{g}", f"decoder.layers.{local}"
        attn = f"{src}.self_attn"
        out[f"{dst}.input_layernorm.weight"] = sd[f"{src}.input_layernorm.weight"]
        out[f"{dst}.self_attention.linear_qkv.weight"] = tp(qkv_weight(cfg, sd, attn), 0, "qkv")
        out[f"{dst}.self_attention.linear_proj.weight"] = tp(sd[f"{attn}.o_proj.weight"], 1, "o")
        out[f"{dst}.self_attention.q_layernorm.weight"] = sd[f"{attn}.q_norm.weight"]
        out[f"{dst}.self_attention.k_layernorm.weight"] = sd[f"{attn}.k_norm.weight"]
        out[f"{dst}.pre_mlp_layernorm.weight"] = sd[f"{src}.post_attention_layernorm.weight"]
        out[f"{dst}.mlp.router.weight"] = sd[f"{src}.mlp.gate.weight"]
        for j, expert in enumerate(experts):
            e = f"{src}.mlp.experts.{expert}"
            x = f"{dst}.mlp.experts.local_experts.{j}"
            gate = etp(sd[f"{e}.gate_proj.weight"], 0, "gate")
            up = etp(sd[f"{e}.up_proj.weight"], 0, "up")
            out[f"{x}.linear_fc1.weight"] = torch.cat([gate, up])
            out[f"{x}.linear_fc2.weight"] = etp(sd[f"{e}.down_proj.weight"], 1, "down")
    if pp_rank == layout.pp - 1:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        out["output_layer.weight"] = tp(sd["lm_head.weight"], 0, "lm_head")
    return {k: v.to(dtype) for k, v in out.items()}


def split_qkv(cfg: Qwen3MoeConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of `qkv_weight`: the global linear_qkv rows back to (q, k, v) weights."""
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    w = qkv.reshape(groups, per_group + 2, d, qkv.shape[-1])
    return (w[:, :per_group].reshape(-1, qkv.shape[-1]).contiguous(),
            w[:, per_group].reshape(-1, qkv.shape[-1]).contiguous(),
            w[:, per_group + 1].reshape(-1, qkv.shape[-1]).contiguous())  # fmt: skip


_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
}
_TOP_PARAMS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_tensors_of(
    cfg: Qwen3MoeConfig, name: str, tensor: torch.Tensor, layer: int | None = None,
    expert: int | None = None,
) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """HF (name, tensor) pairs of one *global* Megatron tensor.

    `name` is the Megatron name with the layer and local-expert index removed
    (`self_attention.linear_qkv.weight`, `mlp.experts.linear_fc1.weight`, or a top-level name);
    `layer` and `expert` are the *global* layer and expert ids: the caller applies the PP layer
    offset and the EP expert offset, each on its own.
    """
    if name in _TOP_PARAMS:
        return [(_TOP_PARAMS[name], tensor)]
    if layer is None:
        raise ValueError(f"Megatron tensor {name!r} is a layer tensor; pass its global layer id")
    p = f"model.layers.{layer}"
    if name == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(cfg, tensor)
        a = f"{p}.self_attn"
        return [(f"{a}.q_proj.weight", q), (f"{a}.k_proj.weight", k), (f"{a}.v_proj.weight", v)]
    if name in _LAYER_PARAMS:
        return [(f"{p}.{_LAYER_PARAMS[name][0]}", tensor)]
    if name.startswith("mlp.experts."):
        if expert is None:
            raise ValueError(f"Megatron tensor {name!r} is an expert tensor; pass its global id")
        e = f"{p}.mlp.experts.{expert}"
        if name == "mlp.experts.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{e}.gate_proj.weight", gate.contiguous()),
                    (f"{e}.up_proj.weight", up.contiguous())]  # fmt: skip
        if name == "mlp.experts.linear_fc2.weight":
            return [(f"{e}.down_proj.weight", tensor)]
    raise ValueError(f"Megatron tensor {name!r} has no HF counterpart in a Qwen3-MoE checkpoint")


def parse_megatron_name(name: str) -> tuple[str, int | None, int | None]:
    """`decoder.layers.{l}.mlp.experts.local_experts.{j}.linear_fc1.weight` ->
    (`mlp.experts.linear_fc1.weight`, l, j): the name without indices, then the *local* layer
    and local expert ids (None where the tensor has none)."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"] or not parts[2].isdigit():
        return name, None, None
    layer, rest = int(parts[2]), parts[3:]
    if rest[:3] == ["mlp", "experts", "local_experts"] and rest[3].isdigit():
        return ".".join(["mlp", "experts", *rest[4:]]), layer, int(rest[3])
    return ".".join(rest), layer, None


def megatron_to_hf(cfg: Qwen3MoeConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF weights, in the checkpoint's order, from a world-1 (unsharded) GPTModel state dict.

    Only parameters are mapped (`_extra_state` entries are skipped); anything else, and any HF
    tensor left unfilled, is refused by name.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("._extra_state"):
            continue
        base, layer, expert = parse_megatron_name(name)
        for hf_name, hf_t in hf_tensors_of(cfg, base, t, layer, expert):
            if hf_name in out:
                raise ValueError(f"Megatron state dict maps twice onto {hf_name} (from {name})")
            out[hf_name] = hf_t
    check_hf_weights(cfg, out)
    extra = sorted(set(out) - set(hf_tensor_shapes(cfg)))
    if extra:
        raise ValueError(f"Megatron state dict has tensors outside the config: {extra[:3]}")
    return {k: out[k] for k in hf_tensor_shapes(cfg)}
