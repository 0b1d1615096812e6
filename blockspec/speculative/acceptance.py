"""Acceptance policies: how many drafts of each verify block are kept, given the target's own choice at every row.

The engine takes a policy at construction (`LLMEngine(..., acceptance=...)`); the decode step and the varlen step
call the same `accept`, so both paths commit the same tokens. `TargetAcceptance` is the lossless rule every user
runs; `ForcedAcceptance` exists for benchmarks only (throughput at a chosen tau off random weights)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from blockspec import rng
from blockspec.sampling import SamplingRows, processed_probs_rows
from blockspec.speculative.verify import accept_probabilistic, accept_tokens


class AcceptancePolicy(ABC):
    @abstractmethod
    def accept(self, drafts: torch.Tensor, chosen: torch.Tensor, seeds: torch.Tensor,
               start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """drafts [G, K], the target's choice at each verify row chosen [G, K+1], the requests' seeds [G] and bonus
        positions start [G] -> (emitted tokens [G, K+1] (-1 after the last), num_accepted [G]). Device-only."""


class TargetAcceptance(AcceptancePolicy):
    """A draft is accepted while it equals the target's choice (argmax, or its seeded sample) at the row before."""

    def accept(self, drafts: torch.Tensor, chosen: torch.Tensor, seeds: torch.Tensor,
               start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return accept_tokens(drafts, chosen)


class ForcedAcceptance(AcceptancePolicy):
    """BENCHMARK ONLY: n drafts accepted per block with mean tau - 1, whatever the drafts are, pseudo-random by
    request seed and block start (so both engine paths force the same n). Emits the target's own choices, so
    outputs are meaningless; the step's work and shapes are those of a real step at that tau."""

    def __init__(self, tau: float) -> None:
        self.tau = tau

    def accept(self, drafts: torch.Tensor, chosen: torch.Tensor, seeds: torch.Tensor,
               start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        K = drafts.shape[1]
        want = min(max(self.tau - 1.0, 0.0), float(K))
        u = rng.uniform(seeds, start, rng.STREAM_BENCH, 1)[:, 0]
        return chosen, (int(want) + (u < want - int(want)).long()).clamp_max(K)


def accept_sampled(drafts: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, rows: SamplingRows,
                   start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p/q rejection of drafts sampled from q: drafts [B, K], q [B, K, V], the target's verify logits [B, K+1, V],
    the requests' sampling rows [B] and bonus positions `start` [B] -> (emitted tokens [B, K+1], num_accepted [B]).
    Uniforms are keyed by the draft positions, the residual sample by the block start."""
    B, K1, V = logits.shape
    K = K1 - 1
    p = processed_probs_rows(logits.reshape(B * K1, V), rows.repeat(K1)).view(B, K1, V)
    pos = (start[:, None] + 1 + torch.arange(K, device=start.device)).flatten()
    u = rng.uniform(rows.seeds.repeat_interleave(K), pos, rng.STREAM_ACCEPT, 1).view(B, K)
    noise = rng.exponential(rows.seeds, start, rng.STREAM_RESIDUAL, V)
    return accept_probabilistic(drafts, p, q, u, noise)


def accept_block(policy: AcceptancePolicy, drafts: torch.Tensor, chosen: torch.Tensor, rows: SamplingRows,
                 start: torch.Tensor, q: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of verify blocks: drafts [G, K], the target's choices chosen [G, K+1], sampling rows [G], bonus
    positions start [G]; with sampled drafts also their q [G, K, V] and the verify logits [G, K+1, V]. Greedy rows
    (and every row without q) go through the policy, sampled rows through p/q rejection."""
    tokens, n = policy.accept(drafts, chosen, rows.seeds, start)
    if q is None or rows.all_greedy:
        return tokens, n
    sampled_tokens, sampled_n = accept_sampled(drafts, q, logits, rows, start)
    sampled = rows.temperature > 0
    return torch.where(sampled[:, None], sampled_tokens, tokens), torch.where(sampled, sampled_n, n)
