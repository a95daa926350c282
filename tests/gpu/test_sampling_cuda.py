"""The sampling rule on CUDA: the noise has the CPU's bits, and a batch of 64 rows at Qwen3's
vocabulary samples each row as it would alone (tokens, and log-prob bits). Control: the same
rows drawn the plain way on the GPU (one CUDA generator for the batch) give row 1 other bits
than a draw of row 1 alone."""

from __future__ import annotations

import pytest
import torch
from onpolicy.bits import as_bits
from onpolicy.models.sampling import log_softmax_rows, noise_key, sample_rows, uniform_noise

pytestmark = pytest.mark.gpu
VOCAB = 151936


def test_cuda_noise_has_the_cpu_bits():
    keys = [noise_key(4, 0, t) for t in range(8)] + [noise_key(2**62, 7, 10**6)]
    cpu = uniform_noise(keys, VOCAB, "cpu")
    cuda = uniform_noise(keys, VOCAB, "cuda")
    assert torch.equal(as_bits(cuda).cpu(), as_bits(cpu))
    # Control: a CUDA generator's draw has other bits than a CPU one's of the same seed.
    g_cpu = torch.Generator().manual_seed(4)
    g_cuda = torch.Generator(device="cuda").manual_seed(4)
    a = torch.rand(VOCAB, generator=g_cpu)
    b = torch.rand(VOCAB, generator=g_cuda, device="cuda")
    assert not torch.equal(as_bits(b).cpu(), as_bits(a))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_row_samples_as_it_would_alone_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, VOCAB, generator=g, device="cuda") * 4).to(dtype)
    temps = [1.0] * 40 + [0.0] * 8 + [0.7] * 16
    keys = [noise_key(1, 0, 100 + i) for i in range(64)]
    tokens, lps = sample_rows(logits, temps, keys)
    rows = log_softmax_rows(logits, temps)
    for i in range(64):
        t1, l1 = sample_rows(logits[i : i + 1], [temps[i]], [keys[i]])
        assert tokens[i].item() == t1.item(), i
        assert as_bits(lps[i]).item() == as_bits(l1[0]).item(), i
        r1 = log_softmax_rows(logits[i : i + 1], [temps[i]])
        assert torch.equal(as_bits(rows[i]), as_bits(r1[0])), i
    assert torch.equal(tokens[40:48], torch.argmax(logits[40:48], -1))
    # Control: one CUDA generator drawing the batch gives row 1 other bits than drawing it alone.
    plain = torch.rand(64, VOCAB, generator=torch.Generator(device="cuda").manual_seed(3),
                       device="cuda")  # fmt: skip
    alone = torch.rand(VOCAB, generator=torch.Generator(device="cuda").manual_seed(3),
                       device="cuda")  # fmt: skip
    assert not torch.equal(as_bits(plain[1]), as_bits(alone))
