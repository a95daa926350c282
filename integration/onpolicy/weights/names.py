"""Where every trainer tensor lives and what it is called in HF: the sync plan, derived once.

A Megatron rank holds local names: `decoder.layers.{l}` counts from its pipeline stage's first
layer, `local_experts.{j}` from its EP rank's first expert. The HF name needs the global ids,
and the two offsets are independent: the PP layer offset comes from the stage, the EP expert
offset from the EP rank, whatever the other degree is. `sync_items` lists every tensor once,
in HF order, with the rank that sends it and how its shards are joined.
"""

from __future__ import annotations

from dataclasses import dataclass

from onpolicy.layout import ParallelLayout
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig


@dataclass(frozen=True, slots=True)
class Item:
    """One Megatron tensor to move, as held by the ranks of one TP (or ETP) group."""

    local: str
    """Its name on the owning ranks (local layer and expert ids)."""
    base: str
    """The name without ids, as `onpolicy.train.hf_megatron.hf_tensors_of` takes it."""
    layer: int | None
    """Global layer id (the PP offset applied), None for the embedding, final norm and head."""
    expert: int | None
    """Global expert id (the EP offset applied), None for non-expert tensors."""
    stage: int
    """The pipeline stage holding it."""
    ep_rank: int
    """The EP rank holding it (0 for non-expert tensors)."""
    join: str
    """How the shards join: "rep" (replicated), "cat0"/"cat1" (concatenate along dim 0/1 over
    TP or ETP), "fc1" ([gate_r; up_r] per ETP rank: gates then ups)."""
    shape: tuple[int, ...]
    """The global (joined) shape."""

    @property
    def expert_tensor(self) -> bool:
        return self.expert is not None


_ATTN = (  # (local suffix, join, global shape by cfg)
    ("input_layernorm.weight", "rep", lambda c: (c.hidden_size,)),
    ("self_attention.linear_qkv.weight", "cat0",
     lambda c: ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)),
    ("self_attention.linear_proj.weight", "cat1",
     lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim)),
    ("self_attention.q_layernorm.weight", "rep", lambda c: (c.head_dim,)),
    ("self_attention.k_layernorm.weight", "rep", lambda c: (c.head_dim,)),
    ("pre_mlp_layernorm.weight", "rep", lambda c: (c.hidden_size,)),
    ("mlp.router.weight", "rep", lambda c: (c.num_experts, c.hidden_size)),
)  # fmt: skip


def sync_items(cfg: Qwen3MoeConfig, layout: ParallelLayout) -> list[Item]:
    """Every trainer tensor once, in the HF checkpoint's order."""
    L, E, pp, ep = cfg.num_hidden_layers, cfg.num_experts, layout.pp, layout.ep
    if L % pp or E % ep:
        raise ValueError(f"weight sync: {L} layers over PP={pp} or {E} experts over EP={ep} "
                         "do not split evenly")  # fmt: skip
    per_stage, per_ep = L // pp, E // ep
    h, v, i = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    items = [Item("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None,
                  None, 0, 0, "cat0", (v, h))]  # fmt: skip
    for g in range(L):
        stage, local = divmod(g, per_stage)
        for suffix, join, shape in _ATTN:
            items.append(Item(f"decoder.layers.{local}.{suffix}", suffix, g, None, stage, 0, join,
                              shape(cfg)))  # fmt: skip
        for e in range(E):
            owner, j = divmod(e, per_ep)
            x = f"decoder.layers.{local}.mlp.experts.local_experts.{j}"
            items.append(Item(f"{x}.linear_fc1.weight", "mlp.experts.linear_fc1.weight", g, e,
                              stage, owner, "fc1", (2 * i, h)))  # fmt: skip
            items.append(Item(f"{x}.linear_fc2.weight", "mlp.experts.linear_fc2.weight", g, e,
                              stage, owner, "cat1", (h, i)))  # fmt: skip
    last = pp - 1
    items.append(Item("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None,
                      None, last, 0, "rep", (h,)))  # fmt: skip
    items.append(Item("output_layer.weight", "output_layer.weight", None, None, last, 0, "cat0",
                      (v, h)))  # fmt: skip
    return items


def group_ranks(item: Item, layout: ParallelLayout) -> list[int]:
    """The global ranks whose shards join into `item`, in shard order: the TP group (ETP group
    for experts) of the first replica that holds it (DP rank 0, or expert-DP rank 0)."""
    ranks = []
    for g in range(layout.world):
        if layout.pp_rank(g) != item.stage:
            continue
        if item.expert_tensor:
            if layout.ep_rank(g) == item.ep_rank and layout.edp_rank(g) == 0:
                ranks.append((layout.etp_rank(g), g))
        elif layout.dp_rank(g) == 0:
            ranks.append((layout.tp_rank(g), g))
    return [g for _, g in sorted(ranks)]


def hf_names_by_rank(cfg: Qwen3MoeConfig, layout: ParallelLayout) -> dict[int, list[tuple]]:
    """{sending rank: [(local Megatron name, HF names...)]}: what each group's first rank
    sends, named both ways (the test of the offsets)."""
    from onpolicy.models.hf_layout import hf_tensor_shapes
    from onpolicy.train.hf_megatron import hf_tensors_of

    shapes = hf_tensor_shapes(cfg)
    out: dict[int, list[tuple]] = {}
    for it in sync_items(cfg, layout):
        src = group_ranks(it, layout)[0]
        names = [n for n, _ in hf_tensors_of(cfg, it.base, _probe(it.shape), it.layer, it.expert)]
        for n in names:
            if n not in shapes:
                raise ValueError(f"sync plan names {n}, which the checkpoint does not have")
        out.setdefault(src, []).append((it.local, *names))
    return out


def _probe(shape: tuple[int, ...]):
    import torch

    return torch.empty(shape, device="meta")
