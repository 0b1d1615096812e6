"""Where draft blocks are anchored in a training sequence, and how much each block slot's loss weighs.

A block anchored at position a has ids [x_a, MASK x (B-1)] at positions a..a+B-1 and slot k (1..B-1) is labelled
x_{a+k}, exactly the situation of inference where x_a is the bonus token at position `start` (DFLASH.md section 5).

Anchor rule: an anchor is a response token (loss_mask) whose next token is one too, so slot 1 is always scored.
Near the end of a sequence the block runs past it: rows beyond the last token exist (as they do at inference, where
the drafter cannot know where the answer ends) but carry no label. DFLASH.md's recipe keeps blocks inside the
sequence (a <= L - B); then the end-of-turn token is a label only at slot B-1 of one block per sequence, and a
drafter trained that way never drafts it (0 of 10 HumanEval answers ending in it, docs/training.md), costing a verify
step per answer. A label is used only where loss_mask is true and every earlier label of the block is one too, so
a block that runs from one response into the next user turn is cut at the boundary (the next response's tokens
after it are not scored)."""

from __future__ import annotations

import math

import torch

from blockspec.errors import ConfigError

# The paper's decay constants: gamma 7 / 5 / 4 for blocks of 16 / 10 / 8.
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B in {8, 10, 16}; other B: piecewise-linear through those points, extended with the
    slope of the nearest segment, at least 1."""
    pts = _GAMMA_POINTS
    if block_size <= pts[1][0]:
        (b0, g0), (b1, g1) = pts[0], pts[1]
    else:
        (b0, g0), (b1, g1) = pts[1], pts[2]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] loss weight of each block slot: 0 for slot 0 (the given token), exp(-(k-1)/gamma) for slot k >= 1."""
    if gamma <= 0 or not math.isfinite(gamma):
        raise ConfigError(f"loss gamma={gamma} must be a positive number")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[n] int64: response positions a whose next position is a response position too, ascending."""
    return torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Up to num_anchors distinct eligible anchors, drawn uniformly without replacement, returned ascending (sorted
    anchors keep a sequence's blocks in context order, which makes the attention mask block-sparse)."""
    pool = eligible_anchors(loss_mask)
    if len(pool) > num_anchors:
        pool = pool[torch.randperm(len(pool), generator=gen)[:num_anchors]].sort().values
    return pool


def response_starts(loss_mask: torch.Tensor) -> list[int]:
    """First position of every response segment (where verification of that response starts)."""
    prev = torch.cat([torch.zeros(1, dtype=torch.bool), loss_mask[:-1]])
    return torch.nonzero(loss_mask & ~prev).flatten().tolist()


def num_anchors_of(loss_mask: torch.Tensor, num_anchors: int) -> int:
    return min(num_anchors, len(eligible_anchors(loss_mask)))
