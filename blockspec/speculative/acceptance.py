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


def accept_sampled_drafts(drafts: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, rows: SamplingRows,
                          start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's p/q rejection for drafts sampled from q (probabilistic drafting): drafts [K], q [K, V], the
    target's verify logits [K+1, V] under the request's sampling rows. Uniforms are keyed by the draft positions,
    the residual sample by the block start, so the result does not depend on the batch."""
    K = drafts.shape[0]
    probs = processed_probs_rows(logits, rows)
    seed, device = rows.seeds[:1], logits.device
    u = rng.uniform(seed.expand(K), torch.arange(start + 1, start + K + 1, device=device), rng.STREAM_ACCEPT, 1)
    noise = rng.exponential(seed, torch.tensor([start], device=device), rng.STREAM_RESIDUAL, probs.shape[-1])
    tokens, n = accept_probabilistic(drafts[None], probs[None], q[None], u.T, noise)
    return tokens[0], n
