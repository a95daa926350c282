"""`--bisect`'s trainer side: the same per-layer points (`onpolicy.capture`) during `logprobs()`.

`capture_logprobs(model, sequence, temperature, out_dir)` is collective: every rank hooks the
points of its model chunks, scores the one sequence through `onpolicy.train.logprobs.logprobs`
(one micro-batch, the normal forward-only path), and writes the rows it holds to
`out_dir/trainer-rank<global rank>.pt`; rank 0 adds the `logprob` point and
`trainer-manifest.json`.

Which rows a rank holds: DP replica 0 scores the sequence (the others run a padding segment,
whose rows are dropped); under sequence parallel a TP rank holds its contiguous slice of the
packed rows (norms, o_proj, router, MoE, final norm, the embedding), and every TP rank records
its own; full rows are recorded by TP rank 0; the core attention output (heads) and the logits
(vocab) are feature-sharded over TP and every TP rank records its shard. Each PP stage records
its own layers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from onpolicy.capture import Recorder
from onpolicy.train.megatron_model import unwrap

FEATURE_SHARDED = ("attention", "logits")
"""Points whose features (heads, vocab) are split over TP on the trainer."""


class _Hooks:
    def __init__(self, models: Sequence[torch.nn.Module], positions: torch.Tensor) -> None:
        from megatron.core import parallel_state as ps

        self.tp, self.tp_rank = (ps.get_tensor_model_parallel_world_size(),
                                 ps.get_tensor_model_parallel_rank())  # fmt: skip
        self.positions, self.rec, self.handles = positions, Recorder(), []
        self.num_layers = models[0].config.num_layers
        for m in models:
            if getattr(m, "pre_process", False):
                self._on(m.embedding, -1, "embedding")
            for layer in m.decoder.layers:
                i = layer.layer_number - 1
                self._on(layer.input_layernorm, i, "input_layernorm")
                self._on(layer.self_attention.core_attention, i, "attention")
                self._on(layer.self_attention.linear_proj, i, "o_proj")
                self._on(layer.pre_mlp_layernorm, i, "post_attention_layernorm")
                self.handles.append(layer.mlp.router.register_forward_hook(self._router(i)))
                self._on(layer.mlp, i, "moe")
            if getattr(m, "post_process", False):
                if m.decoder.final_layernorm is not None:
                    self._on(m.decoder.final_layernorm, self.num_layers, "final_norm")
                self._on(m.output_layer, self.num_layers, "logits")

    def _on(self, module: torch.nn.Module, layer: int, op: str) -> None:
        def hook(_mod, _args, out) -> None:
            x = out[0] if isinstance(out, tuple) else out
            self.add(layer, op, x.float() if op == "logits" else x)

        self.handles.append(module.register_forward_hook(hook))

    def _router(self, layer: int):
        def hook(_mod, _args, out) -> None:
            ids, weights = out
            self.add(layer, "router.ids", ids.to(torch.int32))
            self.add(layer, "router.weights", weights.float())

        return hook

    def add(self, layer: int, op: str, values: torch.Tensor) -> None:
        total, rows = len(self.positions), values.shape[0]
        if rows == total:  # every packed row, the same on every TP rank
            if op in FEATURE_SHARDED and self.tp > 1:
                self.rec.add(layer, op, self.positions, values, (self.tp_rank, self.tp))
            elif self.tp_rank == 0:
                self.rec.add(layer, op, self.positions, values)
        elif rows * self.tp == total and op not in FEATURE_SHARDED:  # this rank's SP slice
            self.rec.add(layer, op, self.positions[self.tp_rank * rows : (self.tp_rank + 1) * rows],
                         values)  # fmt: skip
        else:
            raise RuntimeError(
                f"capture_logprobs: layer {layer} {op} has {rows} rows; the micro-batch packs "
                f"{total} at TP {self.tp}"
            )

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def capture_logprobs(model, sequence: Sequence[int], temperature: float,
                     out_dir: str | Path) -> torch.Tensor | None:  # fmt: skip
    """Collective: score `sequence` (token ids) with every rank's points captured into `out_dir`
    (a folder all ranks share). Returns its fp32 log-probs (positions 1..len-1) on global
    rank 0, None elsewhere."""
    from megatron.core import parallel_state as ps

    from onpolicy.train.logprobs import logprobs

    models = [unwrap(m) for m in (model if isinstance(model, list | tuple) else [model])]
    n, tp = len(sequence), ps.get_tensor_model_parallel_world_size()
    if ps.get_data_parallel_rank() == 0:  # as logprobs packs it: the sequence, then padding
        positions = torch.cat([torch.arange(n), torch.full((-n % tp,), -1)])
    else:  # an empty micro-batch: one padding segment of tp tokens
        positions = torch.full((tp,), -1)
    hooks = _Hooks(models, positions)
    try:
        values = logprobs(model, [list(sequence)], temperature, micro_batch_tokens=max(n, 1))
    finally:
        hooks.close()
    out = Path(out_dir)
    hooks.rec.save(out, "trainer", dist.get_rank())
    if values is None:
        dist.barrier()
        return None
    rec = Recorder()
    rec.add(hooks.num_layers, "logprob", torch.arange(n - 1), values[0])
    rec.save(out, "trainer", "result")
    manifest = {"tokens": [int(t) for t in sequence], "num_layers": hooks.num_layers,
                "temperature": temperature}  # fmt: skip
    (out / "trainer-manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    return values[0]
