"""The verification walk over training blocks: the engine's tau on a teacher-forced sequence, from training hits.

At inference a response is decoded block by block: the block at a accepts n drafts, emits n + 1 tokens, and the next
block starts at a + n + 1. Given the acceptance length of a block at every response position (the training forward
scores them all when every position is an anchor), walking those jumps from each response's first token visits
exactly the blocks the engine would verify on that text, so tokens / steps is its tau there. The average over all
anchors (`tau` in the training log) weighs easy stretches by their length instead of by the few steps spent there
and runs well above it."""

from __future__ import annotations

import torch


def walk(anchors: list[int], accepted: list[int], starts: list[int]) -> list[int]:
    """Tokens emitted per step (n + 1) of the walks from each start, over one sequence's blocks (anchors with their
    accepted counts). A walk stops where no block is anchored (past the response, or an anchor not sampled)."""
    at = dict(zip(anchors, accepted))
    steps: list[int] = []
    for a in starts:
        while a in at:
            steps.append(at[a] + 1)
            a += steps[-1]
    return steps


def response_starts(loss_mask: torch.Tensor) -> list[int]:
    """First position of every response segment."""
    prev = torch.cat([torch.zeros(1, dtype=torch.bool), loss_mask[:-1]])
    return torch.nonzero(loss_mask & ~prev).flatten().tolist()
