"""SGLang's Qwen3-MoE ops, each routed to the one exact op in `onpolicy.kernels`.

The patched SGLang call sites hand their module and inputs here when the switch is on; nothing
here is SGLang arithmetic. The reduction orders are the kernels' (docs/exactness.md).

A row-parallel linear (the attention output projection) returns its shard's unrounded fp32
partial; `all_reduce` sums the partials by the tree in rank order, and `rms_norm` rounds the
sum once to the model dtype before the residual add: together that is `kernels.linear`'s own
last step (`combine_partials`). Each rank sums its S / tp of the run's S segments of K
(`onpolicy.segments`), so the tree over the ranks is the run's segment tree: the trainer's and
the reference model's bits at any TP that `row_parallel_exact` allows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from onpolicy import collectives
from onpolicy import kernels as K
from onpolicy.segments import per_rank


def linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`UnquantizedLinearMethod.apply`: column-parallel and replicated layers give rounded
    outputs (rows of the weight are whole); a row-parallel layer gives its fp32 partial."""
    from sglang.srt.layers.linear import RowParallelLinear

    w = layer.weight
    if isinstance(layer, RowParallelLinear):
        tp = layer.input_size // layer.input_size_per_partition  # the layer's own TP group
        if layer.reduce_results and tp > 1:
            raise NotImplementedError(
                f"onpolicy linear: a RowParallelLinear with reduce_results=True at TP {tp} "
                "would sum rounded shards; the exact path sums the fp32 partials at the layer "
                "boundary (reduce_results=False)"
            )
        if bias is not None and tp > 1:
            raise NotImplementedError("onpolicy linear: row-parallel bias is not supported")
        # Qwen3-MoE's one row-parallel linear is the attention output projection (no dense MLP).
        segments = per_rank("attention", tp)
        partial = K.linear_partial(x.reshape(-1, x.shape[-1]), w, segments=segments)
        if bias is not None:
            partial = partial + bias.float()
        return partial.view(*x.shape[:-1], w.shape[0])
    out = K.linear(x.reshape(-1, x.shape[-1]), w, bias)
    return out.view(*x.shape[:-1], w.shape[0])


def lm_head_logits(hidden: torch.Tensor, lm_head: torch.nn.Module,
                   bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`LogitsProcessor._compute_lm_head`: this rank's vocab shard of the logits, in the model
    dtype (SGLang all-gathers the shards, a copy, then widens them to fp32, also exact)."""
    w = lm_head.weight
    return K.linear(hidden.to(w.dtype), w, bias)


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
             post_residual_addition: torch.Tensor | None = None):  # fmt: skip
    """`RMSNorm.forward_native`: the residual add and the norm in one exact op.

    An fp32 `x` in a lower-precision model is a row-parallel sum still owed its rounding; it is
    rounded here, once, as `combine_partials` would.
    """
    if post_residual_addition is not None:
        raise NotImplementedError("onpolicy rms_norm: post_residual_addition is not supported")
    w = norm.weight
    if x.dtype != w.dtype:
        x = K.combine_partials([x], w.dtype)
    return K.rms_norm(x.contiguous(), w, norm.variance_epsilon, residual)


def qk_norm_rope(attn: torch.nn.Module, qkv: torch.Tensor, positions: torch.Tensor):
    """`Qwen3MoeAttention.apply_qk_norm_rope`: per-head RMSNorm of q and k, then neox RoPE
    from the kernels' fp32 table (SGLang's own cos/sin cache is not used)."""
    rot = attn.rotary_emb
    if not rot.is_neox_style or rot.rotary_dim != attn.head_dim:
        raise NotImplementedError(
            f"onpolicy rope: only full neox rotary is exact here (is_neox_style="
            f"{rot.is_neox_style}, rotary_dim={rot.rotary_dim}, head_dim={attn.head_dim})"
        )
    table = getattr(rot, "_onpolicy_table", None)
    if table is None:  # built once per module by the same function the reference uses
        table = K.rope_table(attn.head_dim, rot.base, rot.max_position_embeddings)
        rot._onpolicy_table = table.to(qkv.device)
    t, d = qkv.shape[0], attn.head_dim
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
        raise NotImplementedError(
            f"onpolicy qk_norm_rope: q_norm eps {attn.q_norm.variance_epsilon} != k_norm eps "
            f"{attn.k_norm.variance_epsilon}"
        )
    q, k = K.qk_norm_rope(q.reshape(t, -1, d), k.reshape(t, -1, d), attn.q_norm.weight,
                          attn.k_norm.weight, attn.q_norm.variance_epsilon,
                          positions.view(-1).long(), rot._onpolicy_table)  # fmt: skip
    return q.reshape(t, -1), k.reshape(t, -1), v.contiguous()


def _select_by_owner(gathered: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Row i of the owning rank: gathered [R, T, ...], owner [T] -> [T, ...] (a copy)."""
    idx = owner.view(1, -1, *[1] * (gathered.dim() - 2)).expand(1, *gathered.shape[1:])
    return gathered.gather(0, idx)[0]


def embedding(layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """`VocabParallelEmbedding.forward`: each rank looks up its vocab shard; the rows are then
    all-gathered and each token takes the row of the rank owning its id, a copy, not a sum."""
    if layer.tp_size == 1:
        return K.embedding(ids, layer.weight)
    masked, outside = shard_rows(ids, layer.shard_indices)
    rows = K.embedding(masked.long(), layer.weight)
    group = _tp_group(layer)
    rows_all = collectives.all_gather(rows[None], group.device_group)
    inside = collectives.all_gather((~outside).to(torch.int8)[None], group.device_group)
    return _select_by_owner(rows_all, inside.argmax(dim=0))


def shard_rows(ids: torch.Tensor, s) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id's row in this rank's vocab shard (0 where the rank does not hold it), and where
    it does not: what SGLang's `get_masked_input_and_mask` gives for the shard's indices `s`
    (`VocabParallelEmbeddingShardIndices`), in plain torch ops. SGLang's is `torch.compile`d,
    and compiling it took most of a CPU engine's first rollout at TP 2 (about 5 s)."""
    org = (ids >= s.org_vocab_start_index) & (ids < s.org_vocab_end_index)
    added = (ids >= s.added_vocab_start_index) & (ids < s.added_vocab_end_index)
    # added rows sit after the shard's original rows and their padding
    added_offset = (s.added_vocab_start_index - (s.org_vocab_end_index - s.org_vocab_start_index)
                    - s.num_org_vocab_padding)  # fmt: skip
    rows = torch.where(org, ids - s.org_vocab_start_index,
                       torch.where(added, ids - added_offset, torch.zeros_like(ids)))  # fmt: skip
    return rows, ~(org | added)


def _tp_group(layer: torch.nn.Module):
    """The group the layer's own all-reduce would use."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group, get_tp_group

    return get_attn_tp_group() if getattr(layer, "use_attn_tp_group", False) else get_tp_group()


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`GroupCoordinator.all_reduce`: the fixed pairwise tree over the ranks, in rank order,
    in x's dtype (fp32 for row-parallel partials)."""
    return collectives.tree_all_reduce(x, group)
