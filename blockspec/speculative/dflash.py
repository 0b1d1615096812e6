"""DFlash as a Proposer: a block-diffusion drafter conditioned on the target's tapped hidden states (DFLASH.md).

append_context: the committed rows' taps -> fc -> hidden_norm -> each draft layer's k/v, written into the draft
pages of the pool at the rows' own slots (the context the drafter attends to). propose: one draft forward over
[bonus, MASK x (rows - 1)] per request, attending to that context; the drafts are the argmax of its rows 1..K
(DFlash 1) or the candidate selector's pick (DFlash 2, models/dflash2.py; sampled: speculative/selector.py).
DFlash 2's convolutions run inside each request's block only, so they add no state to the context append."""

from __future__ import annotations

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.kv.pool import CacheShape
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.speculative.proposer import CommittedRows, DraftBatch, Proposal, Proposer, StepModels
from blockspec.speculative.schedule import fingerprint, load_schedule, load_step_ms, recorded_acceptance
from blockspec.speculative.selector import sample_selected


class DFlashProposer(Proposer):
    name = "dflash"

    def __init__(self, draft: LoadedDraft) -> None:
        self.draft, self.spec = draft, draft.spec
        cfg = draft.config
        self.tap_layers = list(draft.spec.target_layer_ids)
        self.cache_shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.cache_dtype = draft.model.dtype  # bf16 under an fp32 target with cpu_bf16_draft
        self.num_draft_tokens = draft.spec.num_draft_tokens
        self.probabilistic = draft.spec.probabilistic_drafting

    def default_draft_len_schedule(self, device: torch.device) -> dict[int, int] | None:
        source = self.draft.source
        return load_schedule(source, device) if source is not None else None

    def recorded_step_ms(self, device: torch.device) -> dict[int, dict[int, float]] | None:
        source = self.draft.source
        return load_step_ms(source, device) if source is not None else None

    def recorded_acceptance(self) -> list[float] | None:
        source = self.draft.source
        return recorded_acceptance(source) if source is not None else None

    def identity(self) -> dict:
        return {**super().identity(), "files": fingerprint(self.draft.source), "dtype": str(self.cache_dtype),
                "draft_vocab_size": self.draft.draft_vocab_size}

    def draft_rows(self, K: int) -> int:
        return self.spec.draft_rows(K)  # the trained block size with full_block_drafting

    def append_context(self, models: StepModels, rows: CommittedRows) -> None:
        pool, slots = models.pool, rows.slots
        kvs = self.draft.model.context_kv(rows.taps, rows.batch.positions,
                                          lambda layer: (pool.draft_k[layer], pool.draft_v[layer], slots))
        for layer, (k, v) in enumerate(kvs):
            if k is not None and v is not None:  # None: the fused GPU prologue wrote them already
                models.backend.store(pool.draft_k[layer], pool.draft_v[layer], k, v, slots)

    def propose(self, models: StepModels, batch: DraftBatch, want_logits: bool = False) -> Proposal:
        B, K, R = batch.bonus.shape[0], batch.num_draft_tokens, batch.rows
        target, model = models.target, self.draft.model
        ids = torch.cat([batch.bonus[:, None],
                         torch.full((B, R - 1), self.spec.mask_token_id, device=batch.bonus.device)], dim=1)
        offs = torch.arange(R, device=batch.bonus.device)
        pos = (batch.start[:, None] + offs).flatten()
        # the block's own k/v are never stored (slots -1); it sees the context at positions < start
        paged = PagedBatch(pos, torch.full_like(pos, -1), batch.query_start, batch.start.int(), batch.block_tables,
                           R, batch.max_kv_len)
        hidden = model(target.embed_tokens(ids.flatten()), pos, models.backend.draft(models.pool, paged), R,
                       outputs=(1, K + 1))
        hidden = hidden.view(B, R, -1)[:, 1:K + 1]
        if want_logits and isinstance(model, DFlash2DraftModel):
            # DFlash 2 draws its drafts itself (each pick conditions the next): q is over the selector's candidates
            return sample_selected(model, hidden, batch, target.lm_head)
        if want_logits:
            logits = model.compute_logits(hidden.reshape(B * K, -1), target.lm_head)
            # argmax of the whole-vocabulary logits: greedy requests of a probabilistic drafter keep these
            return Proposal(logits.max(-1).indices.view(B, K), logits.view(B, K, -1))
        # DFlash 1: the argmax head (over token ids < draft_vocab_size when set); DFlash 2: the selector's greedy pass
        return Proposal(model.block_drafts(hidden, batch.bonus, target.lm_head))
