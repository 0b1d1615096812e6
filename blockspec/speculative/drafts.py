"""The propose stage's output, and the drawing of sampled drafts (probabilistic drafting), batched on the device.

Drafts is what a request carries from the step that proposed them to the step that verifies them: the tokens (host
copy, for the next step's inputs and the trace) and, for drafts sampled from the drafter's distribution, that
distribution q on the device. Both engine paths (the varlen step and the captured decode step) draw sampled drafts
with sample_drafts (speculative/step.propose), stack the q a verify batch accepts with verify_q and accept them with
speculative/acceptance.accept_sampled, keyed by (seed, position) noise, so a request's result does not depend on the
path or the rest of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec import rng
from blockspec.sampling import SamplingRows, processed_probs_rows, race


@dataclass(frozen=True)
class Drafts:
    """One request's next draft block, as proposed: what its next verify step checks (a prefix of it when the
    scheduler's token budget leaves fewer rows)."""

    tokens: list[int]  # [k] d_1..d_k
    probs: torch.Tensor | None = None  # [k, V] fp32 q on the device (sampled drafts), None: argmax drafts

    @property
    def k(self) -> int:
        return len(self.tokens)


NO_DRAFTS = Drafts([])


def sample_drafts(logits: torch.Tensor, argmax: torch.Tensor, rows: SamplingRows,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts drawn from the drafter's processed distribution: logits [B, K, V] of requests whose new bonus sits at
    `start` [B], under their sampling rows [B] -> (drafts [B, K], q [B, K, V]). Greedy rows keep the argmax drafts
    [B, K] (their q is unused: they are accepted by token match)."""
    B, K, V = logits.shape
    q = processed_probs_rows(logits.reshape(B * K, V), rows.repeat(K)).view(B, K, V)
    pos = (start[:, None] + 1 + torch.arange(K, device=start.device)).flatten()
    noise = rng.exponential(rows.seeds.repeat_interleave(K), pos, rng.STREAM_DRAFT, V)
    drawn = race(q.view(B * K, V), noise).view(B, K)
    return torch.where((rows.temperature == 0)[:, None], argmax, drawn), q


def verify_q(blocks: list[Drafts], K: int) -> torch.Tensor | None:
    """The q [G, K, V] of G requests' drafts, the first K of each (what their verify step accepts by p/q rejection):
    zeros for a block drafted by argmax (accepted by token match: its q is never read). None when no block carries a
    q (or K = 0): nothing to reject by p/q."""
    sampled = next((d.probs for d in blocks if d.probs is not None), None)
    if sampled is None or K == 0:
        return None
    zeros = sampled.new_zeros(K, sampled.shape[-1])
    return torch.stack([d.probs[:K] if d.probs is not None else zeros for d in blocks])
