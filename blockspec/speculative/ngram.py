"""N-gram prompt lookup as a Proposer: no weights, no taps. The drafts are what followed the most recent earlier
occurrence of the request's last n tokens (prompt + output, bonus included), trying n = ngram_max down to 1.

Everything stays on the device with static shapes (the decode step captures it): the proposer keeps the token id
of every committed slot in a [num_slots + 1] table (the last entry a sink for skipped rows), gathers each request's
history through its block table, and scores every window position at once. A continuation that runs into the
current position repeats with the match's period (the text "abcabc" after "...abc" drafts "abcabc..."). A request
with no match drafts its bonus token repeated: any draft is lossless, verification rejects what is wrong."""

from __future__ import annotations

import torch

from blockspec.kv.pool import KVPool
from blockspec.speculative.proposer import CommittedRows, DraftBatch, Proposal, Proposer, StepModels


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, num_draft_tokens: int, ngram_max: int) -> None:
        self.tap_layers, self.cache_shape, self.cache_dtype = [], None, None
        self.num_draft_tokens, self.ngram_max, self.probabilistic = num_draft_tokens, ngram_max, False
        self.history: torch.Tensor | None = None  # [num_slots + 1] int64 token id per slot (bind)

    def bind(self, pool: KVPool) -> None:
        slots = pool.num_blocks * pool.block_size
        self.history = torch.full((slots + 1,), -1, dtype=torch.long, device=pool.k.device)

    def append_context(self, models: StepModels, rows: CommittedRows) -> None:
        sink = self.history.shape[0] - 1  # skipped rows all land here (index_put without a host sync)
        self.history[torch.where(rows.slots >= 0, rows.slots, sink)] = rows.token_ids

    def propose(self, models: StepModels, batch: DraftBatch, want_logits: bool = False) -> Proposal:
        hist = self.tokens(batch, models.pool.block_size)
        return Proposal(lookup(hist, batch.start, batch.bonus, self.ngram_max, batch.num_draft_tokens))

    def tokens(self, batch: DraftBatch, block_size: int) -> torch.Tensor:
        """[B, T] each request's token ids by position: the committed ones, the bonus at its position, -1 after it
        (never equal to a token, so nothing matches there). T = block-table columns x block_size + 1: the bonus may
        sit at the first position of a block not allocated yet."""
        W = batch.block_tables.shape[1]
        pos = torch.arange(W * block_size + 1, device=batch.bonus.device)
        slots = batch.block_tables[:, (pos // block_size).clamp_max(W - 1)] * block_size + pos % block_size
        start = batch.start[:, None]
        return torch.where(pos < start, self.history[slots], torch.where(pos == start, batch.bonus[:, None], -1))


def lookup(hist: torch.Tensor, start: torch.Tensor, bonus: torch.Tensor, ngram_max: int, K: int) -> torch.Tensor:
    """hist [B, T] token ids by position (-1 past `start` [B], where the bonus sits) -> drafts [B, K]."""
    B, T = hist.shape
    dev = hist.device
    best = torch.full((B,), -1, dtype=torch.long, device=dev)  # where the continuation starts (-1: no match yet)
    for n in range(min(ngram_max, T), 0, -1):
        L = T - n + 1
        suffix = hist.gather(1, (start[:, None] - n + 1 + torch.arange(n, device=dev)).clamp_min(0))  # [B, n]
        match = torch.ones(B, L, dtype=torch.bool, device=dev)
        for i in range(n):
            match &= hist[:, i:i + L] == suffix[:, i:i + 1]
        j = torch.arange(L, device=dev)
        match &= j[None] <= (start - n)[:, None]  # an earlier occurrence: it ends before the suffix's last token
        last = (match.long() * (j + 1)).amax(dim=1) - 1  # the most recent one (-1: none)
        best = torch.where((best < 0) & (last >= 0), last + n, best)
    found = best >= 0
    begin = torch.where(found, best, start)
    period = start + 1 - begin  # >= 1: positions begin..start hold tokens
    idx = begin[:, None] + torch.arange(K, device=dev)[None] % period[:, None]
    drafts = hist.gather(1, idx)
    return torch.where(found[:, None], drafts, bonus[:, None])
