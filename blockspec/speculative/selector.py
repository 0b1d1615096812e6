"""DFlash 2's sampled drafts (probabilistic drafting with the candidate selector), batched on the device.

Under temperature > 0 the selector draws each draft from q_i = softmax(score_i / T) over its top-k candidates,
the score of every candidate depending on the draft drawn just before it. That q_i, conditional on d_1..d_{i-1},
is exactly the distribution d_i was drawn from, so p/q rejection (speculative/verify.accept_probabilistic) stays
lossless with it. It is handed to the acceptance as a dense [V] row that is zero outside the candidates: a token
the selector could not propose has q = 0 and is only ever emitted from the residual max(p - q, 0).

The draw is keyed by (seed, draft position) on the drafts' stream (blockspec.rng), as DFlash 1's sampled drafts
are, so a request's drafts do not depend on the batch or the step path."""

from __future__ import annotations

import torch
from torch import nn

from blockspec import rng
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.speculative.proposer import DraftBatch, Proposal


def sample_selected(model: DFlash2DraftModel, hidden: torch.Tensor, batch: DraftBatch,
                    lm_head: nn.Module) -> Proposal:
    """hidden [B, K, H]: the drafter's final hidden states at the draft positions of `batch` (whose `sampling`
    rows say each request's temperature and seed) -> Proposal(drafts [B, K], q=[B, K, V]). Greedy rows get the
    selector's greedy pass (their q is unused: they are accepted by token match)."""
    rows = batch.sampling
    if rows is None:
        raise ValueError("sampled DFlash 2 drafts need the batch's sampling rows (DraftBatch.sampling)")
    B, K, _ = hidden.shape
    k = model.candidate_selector.top_k
    pos = (batch.start[:, None] + 1 + torch.arange(K, device=batch.start.device)).flatten()
    noise = rng.exponential(rows.seeds.repeat_interleave(K), pos, rng.STREAM_DRAFT, k).view(B, K, k)
    drafts, q = model.sampled_block_drafts(hidden, batch.bonus, lm_head, rows.temperature, noise)
    return Proposal(drafts, q=q)
