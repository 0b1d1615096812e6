"""A classic draft model as a Proposer: a small autoregressive LM with the target's tokenizer drafts K tokens one
after another (Leviathan et al.), its own K/V in the pool's proposer pages under the target's block tables.

append_context: the draft model runs over the committed rows of the verify forward (prefill chunks, accepted
drafts) and writes their K/V at those rows' slots, the way the target wrote its own. propose: K draft forwards; the
k-th runs the k + 1 in-flight rows [bonus, d_1..d_k] again over the committed context (their K/V live for one pass,
never stored: the pages past the verify window are not reserved), and its last row's argmax is d_{k+1}. A draft
model reads its weights once per forward whatever the rows, so re-running the in-flight rows costs little next to
K weight reads; the shapes stay static for the decode step's graph."""

from __future__ import annotations

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.errors import ConfigError
from blockspec.loading.capabilities import draft_model_refusal
from blockspec.loading.loader import LoadedModel
from blockspec.models.base import AttentionBase
from blockspec.speculative.proposer import CommittedRows, DraftBatch, Proposal, Proposer, StepModels


class _InFlight(AttentionBase):
    """A decoder's attention (AttentionFn) over the committed context in the proposer pages plus the in-flight rows'
    own k/v, causal: the backend's draft attention (which reads the proposer pages) with causal=True, no window."""

    def __init__(self, draft_attention) -> None:
        self.draft_attention = draft_attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return self.draft_attention(layer, q, k, v, scale, True, None)


class DraftModelProposer(Proposer):
    name = "draft-model"

    def __init__(self, draft: LoadedModel, num_draft_tokens: int) -> None:
        cfg = draft.config
        if callable(getattr(draft.model, "recurrent_shape", None)):
            # its in-flight rows would need a recurrent state of their own, rolled back after every verify
            raise ConfigError(f"{draft.source.name}: a hybrid model ({cfg.architecture}: linear-attention layers) is "
                              f"not supported as a draft model; use a dense one or a DFlash drafter",
                              field="draft_model")
        why = draft_model_refusal(draft.model)  # sinks, a family's own attention: not what _InFlight computes
        if why is not None:
            raise ConfigError(f"{draft.source.name}: {why}", field="draft_model")
        self.draft, self.model = draft, draft.model
        self.tap_layers, self.probabilistic = [], False
        self.cache_shape = draft.model.kv_cache_shape()  # the pages its layers write (models/decoder.py)
        self.cache_dtype = next(draft.model.parameters()).dtype
        self.num_draft_tokens = num_draft_tokens

    def append_context(self, models: StepModels, rows: CommittedRows) -> None:
        b = rows.batch
        batch = PagedBatch(b.positions, rows.slots, b.query_start, b.kv_lens, b.block_tables, b.max_q_len,
                           b.max_kv_len)
        no_logits = torch.zeros(0, dtype=torch.long, device=rows.token_ids.device)
        self.model(rows.token_ids, b.positions, models.backend.target(models.pool.draft_pool(), batch),
                   logit_rows=no_logits)

    def propose(self, models: StepModels, batch: DraftBatch, want_logits: bool = False) -> Proposal:
        B, K, dev = batch.bonus.shape[0], batch.num_draft_tokens, batch.bonus.device
        ids = batch.bonus[:, None]  # [B, k + 1]: the in-flight rows
        kv_lens = batch.start.int()  # the committed context: positions < start
        for k in range(K):
            rows = k + 1
            pos = (batch.start[:, None] + torch.arange(rows, device=dev)).flatten()
            query_start = torch.arange(B + 1, device=dev, dtype=torch.int32) * rows
            paged = PagedBatch(pos, torch.full_like(pos, -1), query_start, kv_lens, batch.block_tables, rows,
                               batch.max_kv_len)
            last = torch.arange(B, device=dev) * rows + k
            out = self.model(ids.flatten(), pos, _InFlight(models.backend.draft(models.pool, paged)), logit_rows=last)
            ids = torch.cat([ids, out.logits.argmax(-1)[:, None]], dim=1)
        return Proposal(ids[:, 1:])
