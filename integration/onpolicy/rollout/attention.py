"""The `onpolicy` attention backend: SGLang's paged KV pool read by `kernels.paged_attention`.

Prefill, chunked prefill (extend over a cached prefix, from the radix cache or an earlier
chunk) and decode are one computation: the new tokens' keys and values are written into the
pool first, then each request's queries attend over its whole history gathered from the pool
through `req_to_token`, in the kernels' fixed key-block order. A token's attention output
therefore depends only on its own prefix, never on how that prefix reached the cache.
SGLang's pool is page_size 1: slot i of the pool is a page of one position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from onpolicy import kernels as K

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


class OnpolicyAttnBackend(AttentionBackend):
    """Causal self-attention of decoder layers through `onpolicy.kernels.paged_attention`."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if model_runner.page_size != 1:
            raise NotImplementedError(
                f"onpolicy attention: page_size {model_runner.page_size}; the pool is read one "
                "slot per position (pass page_size=1)"
            )
        self._paged: K.PagedBatch | None = None
        self._paged_for: ForwardBatch | None = None
        self._last_layer = -1

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing before the forward: its first attention layer builds the batch (`_batch`)."""

    # A decode graph: the forward reads the runner's static buffers (req_pool_indices, seq_lens,
    # out_cache_loc) and the kernels take their lengths and tables from the device, so capture
    # needs no state of its own and a replay recomputes everything from the refilled buffers.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """No graph-owned buffers: see above."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """A padded slot of a captured batch attends over one key (its own, garbage, discarded)."""
        return 1

    def _attend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                save_kv_cache: bool, decode: bool) -> torch.Tensor:  # fmt: skip
        if layer.is_cross_attention or layer.sliding_window_size not in (None, -1):
            raise NotImplementedError(
                "onpolicy attention serves causal full attention only (layer "
                f"{layer.layer_id}: cross={layer.is_cross_attention}, "
                f"window={layer.sliding_window_size})"
            )
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        pages_k = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, 1, hkv, d)
        pages_v = self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, 1, hkv, d)
        q3 = q.reshape(-1, hq, d)
        out = K.paged_attention(q3, pages_k.to(q.dtype), pages_v.to(q.dtype),
                                self._batch(forward_batch, layer.layer_id, decode),
                                layer.scaling)  # fmt: skip
        return out.reshape(q3.shape[0], hq * layer.v_head_dim)

    def _batch(self, forward_batch: ForwardBatch, layer_id: int, decode: bool) -> K.PagedBatch:
        """The forward's `PagedBatch`, built by its first attention layer and reused by the
        others, so the kernels derive its schedule once a forward, not once a layer. A layer
        whose id is not above the last one's starts a new forward: every forward (eager, a
        warm-up, a capture) builds its own batch, inside the graph when it is captured."""
        if (self._paged is None or self._paged_for is not forward_batch
                or layer_id <= self._last_layer):  # fmt: skip
            # Tables, lengths and offsets stay on the device (no list, no read-back): each
            # request's pool row is its page table (page_size 1), of which the kernel reads
            # its first kv_len slots.
            tables = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
            new_lens = (torch.ones_like(forward_batch.seq_lens) if decode  # one token a request
                        else forward_batch.extend_seq_lens)  # fmt: skip
            cu = torch.nn.functional.pad(torch.cumsum(new_lens, 0), (1, 0))
            self._paged = K.PagedBatch(cu, tables, forward_batch.seq_lens)
            self._paged_for = forward_batch
        self._last_layer = layer_id
        return self._paged

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:  # fmt: skip
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, decode=False)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:  # fmt: skip
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, decode=True)

    def support_triton(self) -> bool:
        return False
