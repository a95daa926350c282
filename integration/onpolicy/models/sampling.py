"""The sampling rule the reference model and the exact engine share: Gumbel-max over
log_softmax(logits / T), greedy at T = 0, with counter-based noise.

A request's noise at a step is a function of (seed, request id, step) and the vocabulary column
alone. `noise_key` hashes the first three into 64 bits (blake2b); `uniform_noise` mixes every
column index with the key's two 32-bit words in integer arithmetic (two keyed rounds of the
lowbias32 mixer) and keeps the top `NOISE_BITS` bits as a uniform in (0, 1). Integer arithmetic
gives the same bits on every device and in any batch, and a whole batch's noise is a few
elementwise passes on the logits' device: no host draw per row, no copy, no host sync.

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

NOISE_BITS = 23
"""Bits of a uniform: (k + 0.5) / 2^23 is exact in fp32 and never 0 or 1."""
NOISE_CHUNK = 1 << 23
"""Noise elements made at once (rows x vocab): bounds the int64 temporaries to 64 MiB each."""
_M32 = 0xFFFF_FFFF


def noise_key(seed: int, rid: int, step: int) -> int:
    """The 64-bit noise key of (seed, request id, step): independent of the batch."""
    digest = hashlib.blake2b(f"{seed}:{rid}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32, in place, for int64 x in [0, 2^32): by c's 16-bit halves, so no product
    reaches 2^63 (int64 overflow is not defined alike on every device)."""
    hi = x * (c >> 16)
    hi &= 0xFFFF
    hi <<= 16
    x *= c & 0xFFFF
    x += hi
    x &= _M32
    return x


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' hash-prospector), in place: a bijection of 32-bit words with full
    avalanche."""
    x ^= x >> 16
    x = _mul32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32(x, 0x846CA68B)
    x ^= x >> 16
    return x


def uniform_noise(keys: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[len(keys), vocab] fp32 uniforms in (0, 1), row i from keys[i]: the same bits on every
    device."""
    words = torch.tensor([[k & _M32, (k >> 32) & _M32] for k in keys], dtype=torch.int64)
    words = words.reshape(-1, 2).to(device)
    h = torch.arange(vocab, dtype=torch.int64, device=device) ^ words[:, :1]
    h = _mix32(h)
    h ^= words[:, 1:]
    h = _mix32(h)
    h >>= 32 - NOISE_BITS
    return (h.to(torch.float32) + 0.5) * 2.0**-NOISE_BITS


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
    for t in sorted(set(temperatures)):
        idx = [i for i, ti in enumerate(temperatures) if ti == t]
        whole = len(idx) == n  # the usual batch: one temperature, no gather
        at = torch.tensor(idx, dtype=torch.int64, device=logits.device)
        rows = logits if whole else logits.index_select(0, at)
        if t == 0:
            tok = torch.argmax(rows, dim=-1)
        else:
            tok = _sample_at(rows, t, keys if whole else [keys[i] for i in idx])
        lp = K.token_logprobs(rows, tok, t if t > 0 else 1.0)
        tokens.index_copy_(0, at, tok)
        lps.index_copy_(0, at, lp)
    return tokens, lps


def log_softmax_rows(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """Whole fp32 log-prob rows [R, V]: log_softmax(logits / T) of row i at temperatures[i]
    (T 1 when greedy), the rows at one temperature together."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for t in sorted(set(temperatures)):
        at = torch.tensor([i for i, ti in enumerate(temperatures) if ti == t],
                          dtype=torch.int64, device=logits.device)  # fmt: skip
        rows = logits if at.numel() == logits.shape[0] else logits.index_select(0, at)
        out.index_copy_(0, at, K.log_softmax(K.scale_logits(rows, t if t > 0 else 1.0)))
    return out
