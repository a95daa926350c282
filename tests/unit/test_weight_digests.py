"""The weight check's digests (onpolicy.rollout.weights): hashed on threads, each tensor's
digest is its own SHA-256, in order, and a tensor whose bits differ in one place gets another."""

from __future__ import annotations

import hashlib

import torch
from onpolicy.rollout.weights import Hasher, digest, digests


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (17, 5), (128, 64), (1,), (2, 3, 4)] * 8
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]


def test_digests_are_each_tensors_own_sha256_in_order():
    ts = tensors()
    want = [hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for t in ts]  # fmt: skip
    assert digests(ts) == want == [digest(t) for t in ts]
    # a strided view is hashed as its values, not its storage
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert digest(t.t()) == digest(t.t().contiguous()) != digest(t)


def test_one_flipped_bit_changes_that_digest_only():
    ts = tensors()
    before = digests(ts)
    bits = ts[7].view(torch.int16)
    bits.view(-1)[3] ^= 1
    after = digests(ts)
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [7]


def test_the_hasher_keeps_at_most_two_waiting_per_thread():
    ts = tensors()
    with Hasher(threads=2) as h:
        futures = []
        for t in ts:
            futures.append(h.submit(t))
            assert len(h._waiting) <= 2 * h.threads
        assert [f.result() for f in futures] == [digest(t) for t in ts]
