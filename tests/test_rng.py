"""Counter-based sampling noise (blockspec/rng.py): uniform in (0, 1) with the right moments, and no correlation
between neighbouring vocabulary columns, positions, streams, or seeds (low and high 32 bits)."""

from __future__ import annotations

import torch

from blockspec import rng


def test_counter_noise_uniform_moments_and_decorrelation():
    # 200 positions x 4096 columns of uniforms: mean 1/2, variance 1/12, no correlation between neighbouring
    # columns, neighbouring positions, streams or seeds (tolerances ~6 standard errors: deterministic, not flaky).
    u = rng.uniform(torch.full((200,), 11), torch.arange(200), rng.STREAM_TARGET, 4096).double()
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 6 * (1 / 12) ** 0.5 / (u.numel() ** 0.5)
    assert abs(float(u.var()) - 1 / 12) < 1e-3

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    bound = 6 / (u[:, 1:].numel() ** 0.5)
    assert abs(corr(u[:, 1:], u[:, :-1])) < bound
    assert abs(corr(u[1:], u[:-1])) < bound
    other_stream = rng.uniform(torch.full((200,), 11), torch.arange(200), rng.STREAM_DRAFT, 4096).double()
    other_seed = rng.uniform(torch.full((200,), 12), torch.arange(200), rng.STREAM_TARGET, 4096).double()
    assert abs(corr(u, other_stream)) < bound and abs(corr(u, other_seed)) < bound
    high_bits = rng.uniform(torch.full((200,), 11 + (1 << 40)), torch.arange(200), rng.STREAM_TARGET, 4096).double()
    assert abs(corr(u, high_bits)) < bound  # the seed's upper 32 bits matter too
