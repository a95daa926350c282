"""The sampling rule the reference model and the exact engine share: Gumbel-max over
log_softmax(logits / T), greedy at T = 0, with counter-based noise.

A request's noise at a step is a function of (seed, request id, step) and the vocabulary column
alone. `noise_key` hashes the first three into 64 bits (blake2b); `uniform_noise` hands the
key's two 32-bit words to `kernels.uniform_noise`, which mixes every column index with them in
integer arithmetic (two keyed rounds of the lowbias32 mixer) into a uniform in (0, 1). Integer
arithmetic gives the same bits on every device and in any batch, and a whole batch's noise is
one pass on the logits' device (one kernel on CUDA): no host draw per row; only the keys' two
words per row are copied over.

`sample_rows` samples a batch: the rows at one temperature go through the exact ops together
(`kernels.log_softmax`, `kernels.token_logprobs` and argmax are row-invariant, so a row gets the
bits it would get alone), and the log-prob of each token is `token_logprobs` on its row, the
function the trainer's `score` uses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from onpolicy import kernels as K

NOISE_CHUNK = 1 << 23
"""Noise elements made at once (rows x vocab): bounds each temporary (int64 on CPU) to 64 MiB."""
_M32 = 0xFFFF_FFFF


def noise_key(seed: int, rid: int, step: int) -> int:
    """The 64-bit noise key of (seed, request id, step): independent of the batch."""
    digest = hashlib.blake2b(f"{seed}:{rid}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform_noise(keys: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), vocab] fp32 uniforms in (0, 1), row i from keys[i]: the same bits on every
    device."""
    words = torch.tensor([[k & _M32, (k >> 32) & _M32] for k in keys], dtype=torch.int64)
    return K.uniform_noise(words.reshape(-1, 2).to(device), vocab)


def _sample_at(logits: torch.Tensor, temperature: float, keys: Sequence[int]) -> torch.Tensor:
    """Tokens of rows at one temperature > 0: argmax of log_softmax(logits / T) + Gumbel noise,
    in chunks of rows."""
    rows = max(1, NOISE_CHUNK // max(1, logits.shape[-1]))
    out = []
    for a in range(0, logits.shape[0], rows):
        part = logits[a : a + rows]
        lp = K.log_softmax(K.scale_logits(part, temperature))
        u = uniform_noise(keys[a : a + rows], part.shape[-1], part.device)
        out.append(torch.argmax(lp - torch.log(-torch.log(u)), dim=-1))
    return torch.cat(out)


def _by_temperature(temperatures: Sequence[float], device: torch.device):
    """Per distinct temperature, ascending: (t, its rows' indices, those indices on `device`);
    one (t, None, None) when every row has the same temperature (no gather needed)."""
    groups = sorted(set(temperatures))
    if len(groups) == 1:
        yield groups[0], None, None
        return
    for t in groups:
        idx = [i for i, ti in enumerate(temperatures) if ti == t]
        yield t, idx, torch.tensor(idx, dtype=torch.int64, device=device)


def sample_rows(
    logits: torch.Tensor, temperatures: Sequence[float], keys: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [R], their fp32 log-probs [R]) on the logits' device, from logits [R, V]:
    row i at temperatures[i] with the noise of keys[i].

    Greedy (temperature 0): the first argmax of the logits, its log-prob under log_softmax(logits).
    Otherwise Gumbel-max over log_softmax(logits / T) with `uniform_noise(keys[i])`. Each token's
    log-prob is `kernels.token_logprobs` of its row at T (1 when greedy), as `score` computes it.
    """
    n = logits.shape[0]
    if len(temperatures) != n or len(keys) != n:
        raise ValueError(f"sample_rows: {n} rows, {len(temperatures)} temperatures, "
                         f"{len(keys)} keys; want one of each per row")  # fmt: skip
    if any(t < 0 for t in temperatures):
        raise ValueError(f"sample_rows: temperatures must be >= 0, got {list(temperatures)}")
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    lps = torch.empty(n, dtype=torch.float32, device=logits.device)
    for t, idx, at in _by_temperature(temperatures, logits.device):
        if at is None:
            return _sample_group(logits, t, keys)
        tok, lp = _sample_group(logits.index_select(0, at), t, [keys[i] for i in idx])
        tokens.index_copy_(0, at, tok)
        lps.index_copy_(0, at, lp)
    return tokens, lps


def _sample_group(logits: torch.Tensor, t: float, keys: Sequence[int]):
    """`sample_rows` for rows at one temperature t."""
    tok = torch.argmax(logits, dim=-1) if t == 0 else _sample_at(logits, t, keys)
    return tok, K.token_logprobs(logits, tok, t if t > 0 else 1.0)


def log_softmax_rows(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """Whole fp32 log-prob rows [R, V]: log_softmax(logits / T) of row i at temperatures[i]
    (T 1 when greedy), the rows at one temperature together."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for t, _, at in _by_temperature(temperatures, logits.device):
        rows = logits if at is None else logits.index_select(0, at)
        lp = K.log_softmax(K.scale_logits(rows, t if t > 0 else 1.0))
        if at is None:
            return lp
        out.index_copy_(0, at, lp)
    return out
