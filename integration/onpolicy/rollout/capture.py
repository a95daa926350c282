"""`--bisect`'s rollout side: per-layer captures inside SGLang's scheduler processes.

`capture_generate(engine, request, out_dir)` (served as `EngineService.capture_generate`)
empties the radix cache, so the prompt's prefill runs in full, switches capturing on in every
TP rank (`Engine.collective_rpc("onpolicy_capture", path=...)`, the patched scheduler's RPC,
which calls `switch`), generates the one sample the normal way (`rollout.engine.sample`: the
prompt's prefill, then one-token decode steps, the path that produced its rollout log-probs),
and switches capturing off, which writes each rank's rows to `out_dir/rollout-rank<r>.pt`.
The engine must serve nothing else meanwhile: every forward in the window is recorded.

The points (`onpolicy.capture`) are forward hooks on SGLang's Qwen3-MoE modules, the same on
the exact and the stock path, plus the router, which on the exact path is no module:
`onpolicy.rollout.moe` calls `router()` with the ids and weights it routed by. Hidden rows are
the same on every TP rank, so TP rank 0 records them; the attention output (heads) and nothing
else is sharded, and every rank records its heads. Positions come from the model's own
`positions` argument of each forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from onpolicy import kernels as K
from onpolicy.capture import Recorder

_ACTIVE: _Session | None = None
"""This scheduler process's capture, while one is on."""


class _Session:
    def __init__(self, model: torch.nn.Module, out_dir: str) -> None:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        self.rank, self.size = group.rank_in_group, group.world_size
        self.out_dir, self.rec = out_dir, Recorder()
        self.positions: torch.Tensor | None = None
        self.dtype = next(model.parameters()).dtype
        inner = model.model
        self.num_layers = len(inner.layers)
        hooks = [inner.register_forward_pre_hook(self._positions, with_kwargs=True),
                 inner.embed_tokens.register_forward_hook(self._out(-1, "embedding")),
                 inner.norm.register_forward_hook(self._out(self.num_layers, "final_norm")),
                 model.logits_processor.register_forward_hook(self._logits)]  # fmt: skip
        for i, layer in enumerate(inner.layers):
            hooks += [
                layer.input_layernorm.register_forward_hook(self._out(i, "input_layernorm")),
                layer.self_attn.attn.register_forward_hook(self._out(i, "attention", True)),
                layer.post_attention_layernorm.register_forward_pre_hook(self._o_proj(i)),
                layer.post_attention_layernorm.register_forward_hook(
                    self._out(i, "post_attention_layernorm")),
                layer.mlp.register_forward_hook(self._out(i, "moe")),
                layer.mlp.topk.register_forward_hook(self._topk(i)),
            ]  # fmt: skip
        self.hooks = hooks
        self.error: str | None = None

    def add(self, layer: int, op: str, values: torch.Tensor, sharded: bool = False) -> None:
        if self.positions is None:
            self.fail(f"layer {layer} {op} ran before the model's forward gave its positions")
        elif values.shape[0] != self.positions.shape[0]:
            self.fail(f"layer {layer} {op}: {values.shape[0]} rows for "
                      f"{self.positions.shape[0]} positions")  # fmt: skip
        elif sharded and self.size > 1:
            self.rec.add(layer, op, self.positions, values, (self.rank, self.size))
        elif self.rank == 0:
            self.rec.add(layer, op, self.positions, values)

    def _positions(self, _model, args, kwargs) -> None:
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        self.positions = positions.reshape(-1).cpu().clone()  # SGLang reuses the buffer

    def _out(self, layer: int, op: str, sharded: bool = False):
        def hook(_mod, _args, out) -> None:
            self.add(layer, op, out[0] if isinstance(out, tuple) else out, sharded)

        return hook

    def _o_proj(self, layer: int):
        def hook(_mod, args) -> None:
            x = args[0]  # the attention output after its TP sum; the exact path owes it its cast
            if x.dtype != self.dtype:
                x = K.combine_partials([x], self.dtype)
            self.add(layer, "o_proj", x)

        return hook

    def _topk(self, layer: int):
        def hook(_mod, _args, out) -> None:  # SGLang's own router (the stock path)
            self.router(layer, out.topk_ids, out.topk_weights)

        return hook

    def router(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.add(layer, "router.ids", ids.to(torch.int32))
        self.add(layer, "router.weights", weights.float())

    def fail(self, why: str) -> None:
        """Remember the first failure; `close` raises it (a hook that raised would take the
        scheduler down)."""
        self.error = self.error or why

    def _logits(self, _mod, _args, out) -> None:
        logits = out.next_token_logits
        if logits is None or self.rank != 0:
            return
        if logits.shape[0] != 1:
            return self.fail(f"{logits.shape[0]} sampled rows in one forward; capture runs one "
                             "request at a time")  # fmt: skip
        self.rec.add(self.num_layers, "logits", self.positions.max().reshape(1), logits.float())

    def close(self) -> Path:
        for h in self.hooks:
            h.remove()
        if self.error:
            raise RuntimeError(f"onpolicy capture on TP rank {self.rank}: {self.error}")
        return self.rec.save(self.out_dir, "rollout", self.rank)


def switch(model: torch.nn.Module, path: str | None) -> None:
    """The scheduler RPC: start capturing this rank's forwards into `path`, or, with None,
    stop and write them (`rollout-rank<r>.pt`)."""
    global _ACTIVE
    if path is not None:
        if _ACTIVE is not None:
            raise RuntimeError("onpolicy capture: already capturing")
        _ACTIVE = _Session(model, path)
    elif _ACTIVE is not None:
        session, _ACTIVE = _ACTIVE, None
        session.close()


def router(layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """The exact MoE's routing decision, when a capture is on (a no-op otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.router(layer, ids, weights)


def capture_generate(engine, request: dict, out_dir: str | Path) -> dict:
    """Generate one sample (a `RolloutRequest` dict with one prompt) with every TP rank's
    points captured into `out_dir`; returns the sample as `rollout.engine.sample` does.

    Also writes the sampled tokens' log-probs as the `logprob` point and
    `rollout-manifest.json` (the sequence, the layer count, the temperature).
    """
    from onpolicy.rollout.engine import RolloutRequest, sample

    req = RolloutRequest(**request)
    if len(req.prompts) != 1:
        raise ValueError(f"capture_generate: one prompt per capture, got {len(req.prompts)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flushed = engine.flush_cache()
    if not flushed.success:
        raise RuntimeError(f"capture_generate: the engine did not empty its cache: {flushed}")
    engine.collective_rpc("onpolicy_capture", path=str(out))
    try:
        (s,) = sample(engine, req)
    finally:
        engine.collective_rpc("onpolicy_capture", path=None)
    layers = engine.tokenizer_manager.model_config.hf_text_config.num_hidden_layers
    n_prompt = len(s["prompt"])
    rec = Recorder()
    rec.add(layers, "logprob", torch.arange(n_prompt - 1, n_prompt - 1 + len(s["logprobs"])),
            torch.tensor(s["logprobs"], dtype=torch.float32))  # fmt: skip
    rec.save(out, "rollout", "host")
    manifest = {"tokens": s["prompt"] + s["output_ids"], "num_layers": layers,
                "temperature": req.temperature}  # fmt: skip
    (out / "rollout-manifest.json").write_text(json.dumps(manifest))
    return s
