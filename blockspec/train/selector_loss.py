"""The DFlash 2 candidate selector's training loss (docs/training.md, "DFlash 2").

At inference the selector's greedy pass picks, at draft position i, the candidate c (one of the top-k tokens of the
draft logits there) with the highest score(prev, c) = logit_i(c) + (P[prev] * W h_i) . S[c], prev being its own pick
at position i - 1 (the bonus token at i = 1). Verification accepts position i only if every earlier pick equalled the
target's token, so the pick at position i changes the acceptance length only when prev IS the target's previous
token. Training therefore scores the candidates with prev = the true previous token (teacher forcing), and that is
not an approximation: it is exactly the state in which the pick matters, so the leading run of teacher-forced hits of
a block is the acceptance length the greedy pass would get on it (tests/test_train_dflash2.py replays the engine).

The greedy pass picks the label y (the target's next token) iff y is a candidate and its score beats every other
candidate's. The loss is the cross-entropy of softmax(score) over the k candidates against y: its gradient raises
y's score and lowers the others' in proportion to how close they come, a smooth surrogate of that margin (and, for
sampled drafting, the maximum-likelihood fit of the selector's q at temperature 1 to the data's tokens). A row whose
label is not among its candidates gets no selector loss: no pick can be right there; getting y into the top-k is the
block loss's job (its cross-entropy over the whole vocabulary).

The unary logits enter the score detached: the block loss already trains them over the whole vocabulary, and a
gradient through k gathered lm_head rows per draft row would cost [rows, k, hidden] memory. The gradient reaches the
codebooks, the hidden projection, and through W h_i the draft's hidden states (cheap: [rows, rank])."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.models.dflash2_selector import CandidateSelector


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
                  unary: torch.Tensor, cand: torch.Tensor, w: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [R, H] (final-normed draft hidden states of the scored rows), prev [R] (the true token before each
    row's label), labels [R], unary / cand [R, k] (the rows' top-k logits and token ids, sorted as at inference),
    w [R] (row weights) -> (w * CE over the candidates [R], 0 where the label is not a candidate; hits [R]: the
    teacher-forced greedy pick equals the label; found [R]: the label is a candidate)."""
    proj = selector.hidden_projection(hidden).float()
    succ = F.embedding(cand, selector.successor_codebook).float()  # [R, k, r]
    scores = selector.score(proj, prev, succ, unary.detach())  # [R, k]: the inference pass's formula
    is_label = cand == labels[:, None]
    found = is_label.any(1)
    target = is_label.float().argmax(1)  # the label's candidate index (0 where absent: masked out below)
    ce = torch.logsumexp(scores, 1) - scores.gather(1, target[:, None])[:, 0]
    hits = found & (scores.argmax(1) == target)
    return torch.where(found, ce, torch.zeros_like(ce)) * w, hits.detach(), found
