"""`onpolicy.models.sampling`: the counter-based noise is lowbias32 as written in plain Python
integers, each row's noise and sample are those it gets alone (bits), and Gumbel-max with it
samples softmax(logits / T). Controls: a batch drawn the plain way (one generator for the
batch) gives a row other bits than alone; the frequency check rejects samples at another
temperature."""

from __future__ import annotations

import math

import pytest
import torch
from onpolicy.bits import as_bits
from onpolicy.models import sampling
from onpolicy.models.sampling import noise_key, sample_rows, uniform_noise

M32 = 0xFFFF_FFFF


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def python_uniform(key: int, col: int) -> float:
    h = lowbias32(lowbias32(col ^ (key & M32)) ^ (key >> 32))
    return ((h >> 9) + 0.5) / 2**23


def test_noise_is_lowbias32_as_written():
    keys = [noise_key(s, r, t) for s, r, t in [(0, 0, 0), (7, 3, 11), (2**40, 9, 500)]]
    keys.append(next(noise_key(1, 0, t) for t in range(64) if noise_key(1, 0, t) >= 2**63))
    cols = [0, 1, 2, 1000, 151935, 2**20 - 1]
    u = uniform_noise(keys, max(cols) + 1, "cpu")
    for i, k in enumerate(keys):
        for c in cols:
            assert u[i, c].item() == python_uniform(k, c), (k, c)
    assert 0.0 < u.min().item() and u.max().item() < 1.0


def test_noise_key_depends_on_each_part():
    base = noise_key(5, 1, 2)
    assert len({base, noise_key(6, 1, 2), noise_key(5, 2, 2), noise_key(5, 1, 3)}) == 4
    assert noise_key(5, 1, 2) == base


def test_a_rows_noise_is_its_noise_alone():
    keys = [noise_key(3, 0, t) for t in range(9)]
    batch = uniform_noise(keys, 4099, "cpu")
    for i, k in enumerate(keys):
        assert torch.equal(as_bits(batch[i]), as_bits(uniform_noise([k], 4099, "cpu")[0]))
    # Control: the plain way, one generator drawing the batch, gives row 1 other bits than a
    # generator drawing row 1 alone.
    g = torch.Generator().manual_seed(3)
    plain = torch.rand(len(keys), 4099, generator=g)
    alone = torch.rand(4099, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(as_bits(plain[1]), as_bits(alone))


def test_noise_is_uniform_and_rows_are_uncorrelated():
    u = uniform_noise([noise_key(11, 0, t) for t in range(32)], 65536, "cpu").double()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    counts = torch.histc(u.flatten(), bins=256, min=0.0, max=1.0)
    expect = n / 256
    chi2 = (((counts - expect) ** 2) / expect).sum().item()
    assert chi2 < 255 + 5 * math.sqrt(2 * 255), chi2  # 5 sigma over the mean of chi2(255)
    x = u - 0.5
    for name, c in [("next column", (x[:, 1:] * x[:, :-1]).mean()),
                    ("next step", (x[1:] * x[:-1]).mean())]:  # fmt: skip
        assert abs(c.item() * 12) < 5 / math.sqrt(x[:, 1:].numel()), name


def frequencies(logits: torch.Tensor, temperature: float, draws: int) -> torch.Tensor:
    rows = logits.expand(draws, -1)
    keys = [noise_key(21, 0, t) for t in range(draws)]
    tokens, _ = sample_rows(rows, [temperature] * draws, keys)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expect = p * counts.sum()
    return (((counts - expect) ** 2) / expect).sum().item()


def test_gumbel_max_samples_softmax_at_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits.double() / 0.8, -1)
    crit = 20.5  # chi2 with 5 degrees of freedom at p = 0.001
    assert chi2(frequencies(logits, 0.8, 20000), p) < crit
    # Control: samples at T = 1.2 fail the same check against T = 0.8's probabilities.
    assert chi2(frequencies(logits, 1.2, 20000), p) > crit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_row_samples_as_it_would_alone(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 1031, generator=g) * 3).to(dtype)
    temps = [1.0, 0.0, 0.7, 1.0, 0.7, 0.0, 1.3]
    keys = [noise_key(9, 0, t) for t in range(7)]
    monkeypatch.setattr(sampling, "NOISE_CHUNK", 1031 * 2)  # rows in chunks of 2 too
    tokens, lps = sample_rows(logits, temps, keys)
    for i in range(7):
        t1, l1 = sample_rows(logits[i : i + 1], [temps[i]], [keys[i]])
        assert tokens[i].item() == t1.item()
        assert as_bits(lps[i]).item() == as_bits(l1[0]).item()
    rows = sampling.log_softmax_rows(logits, temps)
    greedy = torch.argmax(logits, -1)
    assert torch.equal(tokens[[1, 5]], greedy[[1, 5]])
    # The log-prob is the row's log_softmax at the token (T 1 when greedy).
    assert torch.equal(as_bits(lps), as_bits(rows.gather(-1, tokens[:, None])[:, 0]))


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="2 rows, 1 temperatures, 2 keys"):
        sample_rows(logits, [1.0], [1, 2])
    with pytest.raises(ValueError, match=r"temperatures must be >= 0, got \[1.0, -0.5\]"):
        sample_rows(logits, [1.0, -0.5], [1, 2])
