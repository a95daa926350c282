"""The routed expert ids a rollout used, per token and layer, as SGLang returns them.

An engine started with `return_routed_experts=True` (`exact_engine_args`, SGLang's
`enable_return_routed_experts`) and a request with `return_routed_experts=True` answer with
`meta_info["routed_experts"]`: base64 of little-endian int32 [rows, layers, top_k], the global
expert ids of every token the model ran. SGLang's capturer keeps them per KV slot and returns
positions [start_len, seqlen - 1) of prompt + output (start_len 0 by default): the last output
token is sampled but never run, so rows = len(prompt) + len(output) - 1. On the exact path
`onpolicy.rollout.moe` feeds that capturer the ids `kernels.moe_route` chose.

`encode` / `decode` carry such a tensor through JSON (the `"routed_experts"` field of
`onpolicy.rollout.engine.sample`): {"shape": [rows, layers, top_k], "int32_b64": base64 of the
little-endian int32 bytes}, 4 bytes an id before base64's 4/3.
"""

from __future__ import annotations

import base64
import binascii
import sys

import numpy as np
import torch


def routed_experts(meta_info: dict, num_layers: int, top_k: int) -> torch.Tensor:
    """int32 [len(prompt) + len(output) - 1, num_layers, top_k] global expert ids of positions
    0..n-2 of prompt + output, from a response's `meta_info`.

    Raises ValueError when the field is absent (engine or request without
    return_routed_experts), not int32 base64, not a whole number of [num_layers, top_k] rows,
    or (when meta_info counts the tokens) not one row per position that ran.
    """
    raw = meta_info.get("routed_experts")
    if raw is None:
        raise ValueError(
            "routed_experts: meta_info has no 'routed_experts'; start the engine with "
            "return_routed_experts=True (exact_engine_args) and send the request with "
            "return_routed_experts=True"
        )
    if not isinstance(raw, str):
        raise ValueError(f"routed_experts: expected a base64 string, got {type(raw).__name__}")
    try:
        data = base64.b64decode(raw.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise ValueError(f"routed_experts: not base64: {e}") from e
    row = num_layers * top_k * 4
    if len(data) % row:
        raise ValueError(
            f"routed_experts: {len(data)} bytes are not whole rows of {num_layers} layers x "
            f"top-{top_k} int32 ids ({row} bytes a row)"
        )
    rows = len(data) // row
    prompt, completion = meta_info.get("prompt_tokens"), meta_info.get("completion_tokens")
    if prompt is not None and completion is not None and rows != prompt + completion - 1:
        raise ValueError(
            f"routed_experts: {rows} rows for {prompt} prompt + {completion} output tokens; "
            f"want {prompt + completion - 1} (every position but the last; a start_len > 0 "
            "request returns fewer)"
        )
    return _int32(data).view(rows, num_layers, top_k)


def encode(routes: torch.Tensor) -> dict:
    """A JSON-safe form of an int32 [rows, layers, top_k] tensor (`decode` inverts it)."""
    if routes.dtype != torch.int32 or routes.dim() != 3:
        raise ValueError(
            f"routing.encode: want int32 [rows, layers, top_k], got {routes.dtype} "
            f"{tuple(routes.shape)}"
        )
    arr = routes.detach().cpu().contiguous().numpy().astype("<i4", copy=False)
    return {"shape": list(routes.shape), "int32_b64": base64.b64encode(arr.tobytes()).decode()}


def decode(field: dict) -> torch.Tensor:
    """The int32 [rows, layers, top_k] tensor of an `encode`d field."""
    try:
        shape, raw = [int(n) for n in field["shape"]], field["int32_b64"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"routing.decode: want {{'shape', 'int32_b64'}}, got {field!r:.80}") from e
    data = base64.b64decode(raw.encode("ascii"), validate=True)
    if len(shape) != 3 or len(data) != 4 * shape[0] * shape[1] * shape[2]:
        raise ValueError(f"routing.decode: {len(data)} bytes do not fill int32 {shape}")
    return _int32(data).view(*shape)


def _int32(data: bytes) -> torch.Tensor:
    arr = np.frombuffer(data, dtype="<i4")
    if sys.byteorder != "little":
        arr = arr.astype(np.int32)
    return torch.from_numpy(arr.copy())
