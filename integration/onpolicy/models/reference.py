"""The reference Qwen3-MoE: one process, built only from `onpolicy.kernels`, the numerical spec.

Both engines must reproduce these numbers bit for bit. Two ways to run it, same bits per token:
- `score(sequences)`: packed prefill of whole sequences, per-token log-probs (the trainer's view);
- `prefill(requests, cache)` / `decode(requests, cache)`: generation over a paged KV cache, with
  chunked prefill and per-request seeded sampling (the rollout's view).
A token's logits depend only on its sequence prefix: every kernel is batch-, chunk- and
decode-invariant, so a generated token's log-prob equals its `score` log-prob exactly.

Reads top to bottom: weights, the layers, the forward, then the two ways to drive it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from onpolicy import kernels as K
from onpolicy.models import sampling
from onpolicy.models.hf_layout import read_hf_checkpoint
from onpolicy.models.qwen3_moe_config import Qwen3MoeConfig
from onpolicy.segments import KSegments, current

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer index, q [T, Hq, D], k, v [T, Hkv, D]) -> attention output [T, Hq, D]."""


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# --- layers -----------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype, o_segments: int = 1) -> None:
        super().__init__()
        self.o_segments = o_segments  # S of o_proj's K (onpolicy.segments)
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_q, self.n_kv, self.head_dim, self.eps = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rms_norm_eps,
        )  # fmt: skip
        # q, k and v stacked: one GEMM (each output's dot depends only on its row of w)
        self.qkv_proj = _param(torch.empty((self.n_q + 2 * self.n_kv) * d, h, dtype=dtype))
        self.o_proj = _param(torch.empty(h, self.n_q * d, dtype=dtype))
        self.q_norm = _param(torch.empty(d, dtype=dtype))
        self.k_norm = _param(torch.empty(d, dtype=dtype))

    def forward(self, x, positions, rope_table, attend: Callable) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = K.linear(x, self.qkv_proj).view(t, self.n_q + 2 * self.n_kv, d)
        q, k, v = qkv.split([self.n_q, self.n_kv, self.n_kv], dim=1)
        q, k = K.qk_norm_rope(q, k, self.q_norm, self.k_norm, self.eps, positions, rope_table)
        return K.linear(attend(q, k, v).reshape(t, -1), self.o_proj, segments=self.o_segments)


class SparseMoe(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype, down_segments: int = 1) -> None:
        super().__init__()
        self.down_segments = down_segments  # S of the experts' down-projection K
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = _param(torch.empty(e, h, dtype=dtype))
        self.w_gate = _param(torch.empty(e, i, h, dtype=dtype))
        self.w_up = _param(torch.empty(e, i, h, dtype=dtype))
        self.w_down = _param(torch.empty(e, h, i, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.moe(x, self.gate, self.w_gate, self.w_up, self.w_down, self.top_k,
                     self.renormalize, segments=self.down_segments)  # fmt: skip


class Block(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype, segments: KSegments) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(torch.empty(cfg.hidden_size, dtype=dtype))
        self.self_attn = Attention(cfg, dtype, segments.attention)
        self.post_attention_layernorm = _param(torch.empty(cfg.hidden_size, dtype=dtype))
        self.mlp = SparseMoe(cfg, dtype, segments.experts)

    def forward(self, h, residual, positions, rope_table, attend):
        """(hidden, residual) in, (hidden, residual) out: the residual add is fused in the norm."""
        if residual is None:
            x, residual = K.rms_norm(h, self.input_layernorm, self.eps), h
        else:
            x, residual = K.rms_norm(h, self.input_layernorm, self.eps, residual)
        h = self.self_attn(x, positions, rope_table, attend)
        x, residual = K.rms_norm(h, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(x), residual


# --- the model --------------------------------------------------------------------------------
class Qwen3MoeReference(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype | None = None, *,
                 segments: KSegments | None = None) -> None:  # fmt: skip
        """`segments`: S of the row-parallel matmuls' K (unsplit here, the whole S); default
        this process's ONPOLICY_K_SEGMENTS, else 1 (`onpolicy.segments`). Compare an engine
        or trainer with the reference at the S they ran with: the run's, or their own TP."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype or cfg.dtype
        self.segments = segments if segments is not None else current() or KSegments()
        self.embed_tokens = _param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype))
        self.layers = nn.ModuleList(Block(cfg, self.dtype, self.segments)
                                    for _ in range(cfg.num_hidden_layers))  # fmt: skip
        self.norm = _param(torch.empty(cfg.hidden_size, dtype=self.dtype))
        self.lm_head = _param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype))
        self.register_buffer(
            "rope_table",
            K.rope_table(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings),
            persistent=False,
        )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | None = None, *,
        segments: KSegments | None = None,
    ) -> Qwen3MoeReference:  # fmt: skip
        """Load an HF checkpoint folder (config.json + *.safetensors, hub tensor names)."""
        model = cls(Qwen3MoeConfig.from_hf(path), dtype, segments=segments)
        model.load_state_dict(model._from_hf_names(read_hf_checkpoint(path, strict=False).tensors))
        return model

    @classmethod
    def random(
        cls, cfg: Qwen3MoeConfig, *, dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu", seed: int = 0, segments: KSegments | None = None,
    ) -> Qwen3MoeReference:  # fmt: skip
        """Seeded random weights made directly on `device` (full-size models on one GPU)."""
        with torch.device("meta"):
            model = cls(cfg, dtype, segments=segments)
        model.to_empty(device=device)
        table = K.rope_table(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        model.rope_table = table.to(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith(("norm", "layernorm")):
                p.normal_(1.0, 0.1, generator=gen)
            else:  # std 1/sqrt(fan_in) keeps activations O(1) through the layers
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        return model

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def _from_hf_names(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF hub names (per-expert matrices) -> this module's names (experts stacked)."""
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in hf:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return hf[name].to(self.dtype)

        sd = {"embed_tokens": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in hf
        sd["lm_head"] = sd["embed_tokens"] if tied else take("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                sd[q + n] = take(f"{p}{n}.weight")
            for n in ("o_proj", "q_norm", "k_norm"):
                sd[f"{q}self_attn.{n}"] = take(f"{p}self_attn.{n}.weight")
            sd[f"{q}self_attn.qkv_proj"] = torch.cat(
                [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            )
            sd[q + "mlp.gate"] = take(p + "mlp.gate.weight")
            for ours, theirs in (
                ("w_gate", "gate_proj"),
                ("w_up", "up_proj"),
                ("w_down", "down_proj"),
            ):
                sd[f"{q}mlp.{ours}"] = torch.stack([
                    take(f"{p}mlp.experts.{e}.{theirs}.weight") for e in range(cfg.num_experts)
                ])  # fmt: skip
        return sd

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Logits [len(logit_rows), V] (default every row) of packed `tokens` at `positions`.

        `attend` says where each layer's keys come from (packed or paged); the rest of the
        forward is the same either way.
        """
        h, residual = K.embedding(tokens, self.embed_tokens), None
        for i, block in enumerate(self.layers):
            h, residual = block(h, residual, positions, self.rope_table,
                                lambda q, k, v, i=i: attend(i, q, k, v))  # fmt: skip
        x, _ = K.rms_norm(h, self.norm, self.cfg.rms_norm_eps, residual)
        if logit_rows is not None:
            x = x[logit_rows]
        return K.linear(x, self.lm_head)

    # --- the trainer's view: score packed sequences ---------------------------------------------
    @torch.no_grad()
    def score(
        self, sequences: Sequence[Sequence[int] | torch.Tensor], temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per sequence, fp32 log p(token i | tokens < i) for i = 1..len-1, by packed prefill."""
        seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
        cu = [0, *itertools.accumulate(len(s) for s in seqs)]
        tokens = torch.cat(seqs).to(self.device)
        positions = torch.cat([torch.arange(len(s)) for s in seqs]).to(self.device)
        logits = self(tokens, positions, lambda i, q, k, v: K.attention(q, k, v, cu))
        return [
            K.token_logprobs(logits[a : b - 1], tokens[a + 1 : b], temperature)
            for a, b in zip(cu[:-1], cu[1:], strict=True)
        ]

    # --- the rollout's view: paged prefill and decode -------------------------------------------
    @torch.no_grad()
    def prefill(self, requests: Sequence[Request], cache: PagedKVCache,
                chunk_size: int | None = None) -> None:  # fmt: skip
        """Run every request's uncached tokens through the cache, `chunk_size` tokens per request
        per forward (None: all at once), then sample each request's next token."""
        target = [len(r.tokens) for r in requests]
        while todo := [r for r, n in zip(requests, target, strict=True) if r.kv_len < n]:
            self._step(todo, cache, chunk_size)

    @torch.no_grad()
    def decode(self, requests: Sequence[Request], cache: PagedKVCache) -> None:
        """One token per request: its last sampled token in, the next token sampled."""
        for r in requests:
            if r.pending != 1:
                raise ValueError(f"decode: request {r.rid} has {r.pending} uncached tokens, not 1")
        self._step(list(requests), cache, None)

    def _step(self, requests: Sequence[Request], cache: PagedKVCache, chunk: int | None) -> None:
        """One forward over the next chunk of every request's uncached tokens; a request whose
        tokens are then all cached samples its next token from its last row."""
        starts = [r.kv_len for r in requests]
        new = [r.pending if chunk is None else min(chunk, r.pending) for r in requests]
        ends = [a + n for a, n in zip(starts, new, strict=True)]
        cu = [0, *itertools.accumulate(new)]
        for r, end in zip(requests, ends, strict=True):
            cache.reserve(r, end)
        tables = [cache.page_table(r) for r in requests]
        tokens = torch.tensor(
            [t for r, a, b in zip(requests, starts, ends, strict=True) for t in r.tokens[a:b]],
            device=self.device,
        )
        positions = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends, strict=True)])
        positions = positions.to(self.device)
        batch = K.PagedBatch(cu, tables, ends)

        def attend(layer: int, q, k, v):
            # Keys of the new tokens go into the cache first; attention then reads only the cache.
            for r, a, c0, c1 in zip(requests, starts, cu[:-1], cu[1:], strict=True):
                cache.write(layer, r, a, k[c0:c1], v[c0:c1])
            return K.paged_attention(q, cache.k[layer], cache.v[layer], batch)

        done = [i for i, r in enumerate(requests) if ends[i] == len(r.tokens)]
        logits = self(
            tokens,
            positions,
            attend,
            logit_rows=torch.tensor(
                [cu[i + 1] - 1 for i in done], dtype=torch.long, device=self.device
            ),
        )
        for r, end in zip(requests, ends, strict=True):
            r.kv_len = end
        picked = [requests[i] for i in done]
        tokens, lps = sampling.sample_rows(
            logits,
            [r.temperature for r in picked],
            [sampling.noise_key(r.seed, r.rid, len(r.output)) for r in picked],
        )
        for r, token, lp in zip(picked, tokens.tolist(), lps.tolist(), strict=True):
            r.append(token, lp)

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
        seed: int = 0, chunk_size: int | None = None, page_size: int = 16,
        rids: Sequence[int] | None = None,
    ) -> list[Request]:  # fmt: skip
        """Prefill all prompts together, then decode them together for `max_new_tokens`.

        Request ids default to 0..n-1; with the seed they fix each request's sampling noise.
        """
        rids = range(len(prompts)) if rids is None else rids
        reqs = [Request(rid=i, prompt=list(p), temperature=temperature, seed=seed)
                for i, p in zip(rids, prompts, strict=True)]  # fmt: skip
        longest = max(len(p) for p in prompts) + max_new_tokens
        cache = PagedKVCache(self.cfg, self.dtype, page_size=page_size,
                             num_pages=len(reqs) * -(-longest // page_size),
                             device=self.device)  # fmt: skip
        self.prefill(reqs, cache, chunk_size)
        for _ in range(max_new_tokens - 1):
            self.decode(reqs, cache)
        return reqs


# --- requests and the paged cache -------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Request:
    """One generation: its tokens, where its keys live in the cache, and what it sampled."""

    rid: int
    """Request id; part of the sampling seed, so a request draws the same noise in any batch."""
    prompt: list[int]
    """Prompt token ids."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    seed: int = 0
    """User seed; with rid and the step it keys the request's noise (`sampling.noise_key`)."""
    output: list[int] = field(default_factory=list)
    """Sampled token ids."""
    logprobs: list[float] = field(default_factory=list)
    """fp32 log-prob of each sampled token under log_softmax(logits / temperature)."""
    pages: list[int] = field(default_factory=list)
    """Cache pages holding this request's keys, in position order."""
    kv_len: int = 0
    """Positions already in the cache."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet run through the model (and so not in the cache)."""
        return len(self.prompt) + len(self.output) - self.kv_len

    def append(self, token: int, logprob: float) -> None:
        self.output.append(token)
        self.logprobs.append(logprob)


class PagedKVCache:
    """Keys and values of every layer in fixed-size pages, handed out to requests on demand."""

    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype, *, page_size: int = 16,
                 num_pages: int = 64, device: str | torch.device = "cpu") -> None:  # fmt: skip
        shape = (cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.page_size = page_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.free = list(range(num_pages))

    def reserve(self, req: Request, n: int) -> None:
        while len(req.pages) * self.page_size < n:
            if not self.free:
                raise RuntimeError(f"paged KV cache is out of pages (request {req.rid})")
            req.pages.append(self.free.pop(0))

    def release(self, req: Request) -> None:
        self.free.extend(req.pages)
        req.pages = []

    def page_table(self, req: Request) -> torch.Tensor:
        return torch.tensor(req.pages, dtype=torch.long, device=self.k.device)

    def write(self, layer: int, req: Request, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of positions start.. for `req` (before attention reads them)."""
        self.store(layer, self.slots(req, start, k.shape[0]), k, v)

    def slots(self, req: Request, start: int, n: int) -> torch.Tensor:
        """The flat cache slots (page * page_size + offset) of `req`'s positions start..+n."""
        pos = torch.arange(start, start + n, device=self.k.device)
        return self.page_table(req)[pos // self.page_size] * self.page_size + pos % self.page_size

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows of keys/values [n, Hkv, D] at the cache's flat slots (page * page_size +
        offset): `kernels.kv_store`, one launch for both on CUDA."""
        flat = self.k.shape[-2:]
        K.kv_store(self.k[layer].view(-1, *flat), self.v[layer].view(-1, *flat), slots, k, v)
