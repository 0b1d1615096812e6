"""DFlash as a Proposer: a block-diffusion drafter conditioned on the target's tapped hidden states (DFLASH.md).

append_context: the committed rows' taps -> fc -> hidden_norm -> each draft layer's k/v, written into the draft
pages of the pool at the rows' own slots (the context the drafter attends to). propose: one draft forward over
[bonus, MASK x (rows - 1)] per request, attending to that context; the drafts are the argmax of its rows 1..K
(DFlash 1) or the candidate selector's pick (DFlash 2, models/dflash2.py; sampled: speculative/selector.py).
DFlash 2's convolutions run inside each request's block only, so they add no state to the context append.

On the CPU a step after which nothing is proposed (every request at K' = 0: the draft length policy found drafting
does not pay, or probes it now and then) keeps its committed rows instead of appending them, and the next propose
appends them all first, in one pass: a K = 0 step then costs what a plain step costs (the context pass was ~5 % of
it on the bundled pair), and the rows ride one weight read together. A CUDA step is captured whole, so it appends
every step."""

from __future__ import annotations

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.kv.pool import CacheShape
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.speculative.proposer import CommittedRows, DraftBatch, Proposal, Proposer, StepModels
from blockspec.speculative.schedule import fingerprint, load_schedule, load_step_ms, recorded_acceptance
from blockspec.speculative.selector import sample_selected


# deferred rows appended at once when this many are kept (their taps: ~12 KB a row on the bundled pair)
MAX_DEFERRED_ROWS = 256


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
        self.defer_context = next(draft.model.parameters()).device.type == "cpu"
        # rows kept while no propose follows, oldest first: (taps [n, len(tap_layers) * H], positions [n], slots [n])
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._num_deferred = 0

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
        if self.defer_context and not rows.propose_next:
            keep = rows.slots >= 0
            self._deferred.append((rows.taps[keep], rows.batch.positions[keep], rows.slots[keep]))
            self._num_deferred += self._deferred[-1][2].shape[0]
            if self._num_deferred >= MAX_DEFERRED_ROWS:
                self.flush_context(models)
            return
        self.flush_context(models)  # the kept rows first: a slot written twice keeps its later row
        self._append(models, rows.taps, rows.batch.positions, rows.slots)

    def flush_context(self, models: StepModels) -> None:
        """Append the rows kept by steps that proposed nothing (before anything reads or writes the context)."""
        if not self._deferred:
            return
        taps, positions, slots = (torch.cat(parts) for parts in zip(*self._deferred))
        self._deferred, self._num_deferred = [], 0
        if slots.numel() == 0:
            return
        # a slot kept twice (its request ended and the slot went to another): only its later row is live
        order = torch.arange(slots.shape[0])
        last = torch.full((int(slots.max()) + 1,), -1, dtype=torch.long).scatter_reduce(0, slots, order, "amax")
        live = last[slots] == order
        self._append(models, taps[live], positions[live], slots[live])

    def _append(self, models: StepModels, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        pool = models.pool
        kvs = self.draft.model.context_kv(taps, positions, lambda layer: (pool.draft_k[layer], pool.draft_v[layer], slots))
        for layer, (k, v) in enumerate(kvs):
            if k is not None and v is not None:  # None: the fused GPU prologue wrote them already
                models.backend.store(pool.draft_k[layer], pool.draft_v[layer], k, v, slots)

    def propose(self, models: StepModels, batch: DraftBatch, want_logits: bool = False) -> Proposal:
        self.flush_context(models)
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
