"""The DFlash 2 candidate selector: per draft position, the top-k tokens of the draft logits are the candidates, and a
left-to-right pass picks one of them per position with a low-rank score between the previous pick and each candidate.

  score(prev, c | h_i) = logit_i(c) + sum_r P[prev, r] * W h_i [r] * S[c, r]

P (predecessor codebook) and S (successor codebook) are [vocab, rank] tables, W (hidden projection) maps the draft's
final hidden state at position i to the rank. Position 1's predecessor is the block's anchor (the bonus token).
The pass is sequential in K (each pick conditions the next), so it is a torch loop of K small batched ops with no
host sync: the decode step captures it inside its CUDA graph like everything else.

Checkpoint names (z-lab, loaded as they are): candidate_selector.predecessor_codebook and .successor_codebook are
raw tensors (no `.weight`), candidate_selector.hidden_projection.weight a linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        # plain parameters, not nn.Embedding: the checkpoint stores them without a `.weight` suffix
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, K, V] -> (unary scores [B, K, k] fp32, candidate token ids [B, K, k]). Sorted, so the order
        (and with it which candidate wins an exact tie) is the same on every device and path."""
        unary, ids = torch.topk(logits.float(), self.top_k, dim=-1, sorted=True)
        return unary, ids

    def score(self, proj: torch.Tensor, prev: torch.Tensor, succ: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """One position's candidate scores [N, k] from its projected hidden state proj [N, r] (fp32), the previous
        token prev [N], the candidates' successor codes succ [N, k, r] (fp32) and their unary logits [N, k]. Shared
        by the pass below and by training (train/selector_loss.py), so both score with the same roundings: (predecessor
        code * projected hidden) . successor code, in the reference's order."""
        pred = F.embedding(prev, self.predecessor_codebook).float() * proj  # [N, r]
        return unary + torch.bmm(succ, pred[:, :, None])[..., 0]

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
               temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [B, K, H] (the draft's final hidden states at the draft positions), logits [B, K, V] (its scaled
        logits there), anchor [B] (the bonus token) -> (drafts [B, K], candidates [B, K, k], q [B, K, k] or None).

        Greedy (temperature None): each position picks its best-scoring candidate. Sampled: temperature [B] (0 =
        that row stays greedy) and noise [B, K, k] Exp(1): each position draws from q = softmax(score / T) over its
        candidates by the exponential race; q is returned for p/q rejection (candidates outside the top-k have q = 0).
        """
        unary, cand = self.candidates(logits)
        B, K, k = cand.shape
        proj = self.hidden_projection(hidden.reshape(B * K, -1)).float().view(B, K, -1)
        # every candidate's successor code gathered once, before the loop: inside it only the predecessor changes
        succ = F.embedding(cand, self.successor_codebook).float()  # [B, K, k, r]
        prev = anchor
        picks: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(K):
            scores = self.score(proj[:, i], prev, succ[:, i], unary[:, i])  # [B, k]
            idx = scores.argmax(-1)
            if temperature is not None and noise is not None:
                # a greedy row's temperature 0 is replaced by 1 only to keep its (unused) q finite
                q = torch.softmax(scores / torch.where(temperature > 0, temperature, 1.0)[:, None], dim=-1)
                idx = torch.where(temperature > 0, (q / noise[:, i]).argmax(-1), idx)
                qs.append(q)
            prev = cand[:, i].gather(1, idx[:, None])[:, 0]
            picks.append(prev)
        return torch.stack(picks, 1), cand, (torch.stack(qs, 1) if qs else None)
