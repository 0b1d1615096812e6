"""Runs one engine step on the models: a target forward over every scheduled row (prefill chunks and verify
blocks together, varlen), acceptance, draft-context append for committed rows, and the next draft blocks.

Returns, per sequence, the tokens committed this step; the engine does stop checks and bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.backends import get_backend
from blockspec.attention.paged_ref import PagedBatch, store
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.kv.pool import KVPool
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import processed_probs, sample_from
from blockspec.spec.verify import accept_probabilistic, accept_tokens


@dataclass
class StepResult:
    seq: Sequence
    new_tokens: list[int]  # tokens committed this step (before stop/max_tokens cuts)
    num_accepted: int | None  # drafts accepted (verify rows only)
    num_kv_rows: int  # rows whose target KV + draft context became valid this step


def _slots(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def _batch(items: list[tuple[Sequence, list[int], list[int], list[int], int]], device: torch.device) -> PagedBatch:
    """items: (seq, positions, slots, _, kv_len) per sequence, in batch order."""
    positions, slots, qs, kv_lens = [], [], [0], []
    for seq, pos, sl, _, kv_len in items:
        positions += pos
        slots += sl
        qs.append(qs[-1] + len(pos))
        kv_lens.append(kv_len)
    width = max(len(s.block_table) for s, *_ in items)
    tables = torch.zeros(len(items), max(width, 1), dtype=torch.long)
    for i, (s, *_) in enumerate(items):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    return PagedBatch(torch.tensor(positions, device=device), torch.tensor(slots, device=device), qs, kv_lens,
                      tables.to(device))


class ModelRunner:
    def __init__(self, lm: LoadedModel, draft: LoadedDraft | None, pool: KVPool, max_model_len: int,
                 attention_backend: str = "auto") -> None:
        self.lm, self.draft, self.pool = lm, draft, pool
        self.device = next(lm.model.parameters()).device
        self.target_attn, self.draft_attn = get_backend(attention_backend, self.device)
        self.taps = draft.spec.target_layer_ids if draft is not None else []
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq], num_draft_tokens: int) -> list[StepResult]:
        bs = self.pool.block_size
        items, logit_rows, row = [], [], 0
        for s in scheduled:
            seq, nc = s.seq, s.seq.num_computed
            ids = seq.tokens[nc:nc + s.num_rows] if s.is_prefill else [seq.bonus] + seq.drafts
            pos = list(range(nc, nc + s.num_rows))
            items.append((seq, pos, _slots(seq, nc, s.num_rows, bs), ids, nc + s.num_rows))
            wants_logits = not s.is_prefill or (nc + s.num_rows == seq.prefill_len and not seq.output_ids)
            logit_rows.append(list(range(row, row + s.num_rows)) if not s.is_prefill else ([row + s.num_rows - 1] if wants_logits else []))
            row += s.num_rows
        batch = _batch(items, self.device)
        input_ids = torch.tensor([t for *_, ids, _ in items for t in ids], device=self.device)
        flat_rows = torch.tensor([r for rows in logit_rows for r in rows], dtype=torch.long, device=self.device)
        out = self.lm.model(input_ids, batch.positions, self.target_attn(self.pool, batch), tap_layers=self.taps,
                            logit_rows=flat_rows)
        logits = out.logits
        results: list[StepResult] = []
        ctx_rows: list[int] = []
        li = 0
        for s, rows in zip(scheduled, logit_rows):
            seq = s.seq
            seq_logits = logits[li:li + len(rows)]
            li += len(rows)
            start_row = batch.query_start[len(results)]
            if s.is_prefill:
                ctx_rows += range(start_row, start_row + s.num_rows)
                new = [int(self._sample(seq, seq_logits)[0])] if rows else []
                results.append(StepResult(seq, new, None, s.num_rows))
            else:
                tokens, n = self._accept(seq, seq_logits)
                ctx_rows += range(start_row, start_row + n + 1)
                results.append(StepResult(seq, tokens[: n + 1], n, n + 1))
        if self.draft is not None and ctx_rows:
            self._append_context(out.taps, batch, ctx_rows)
        return results

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        p = seq.params
        if p.greedy:
            return logits.argmax(-1)
        return sample_from(processed_probs(logits, p.temperature, p.top_k, p.top_p), seq.generator)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], int]:
        """logits [K+1, V] for [bonus, d_1..d_K] -> (emitted tokens, number of drafts accepted)."""
        drafts = torch.tensor(seq.drafts, dtype=torch.long, device=self.device)[None]
        p = seq.params
        if seq.draft_probs is not None and not p.greedy:
            probs = processed_probs(logits, p.temperature, p.top_k, p.top_p)
            K = drafts.shape[1]
            u = torch.rand(K, generator=seq.generator, device=self.device)
            noise = torch.empty(probs.shape[-1], device=self.device).exponential_(generator=seq.generator)
            out, n = accept_probabilistic(drafts, probs[None], seq.draft_probs[None, :K], u[None], noise[None])
        else:
            out, n = accept_tokens(drafts, self._sample(seq, logits)[None])
        n_host = int(n[0])
        return out[0, : n_host + 1].tolist(), n_host

    def _append_context(self, taps: torch.Tensor, batch: PagedBatch, rows: list[int]) -> None:
        """Write draft-context K/V of committed rows into the draft pages (same slots as their target KV)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        kvs = self.draft.model.context_kv(taps[idx], batch.positions[idx])
        slots = batch.slot_mapping[idx]
        for layer, (k, v) in enumerate(kvs):
            store(self.pool.draft_k[layer], self.pool.draft_v[layer], k, v, slots)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft the next block for each sequence from its bonus (context = everything before it), in one pass."""
        spec = self.draft.spec
        items = []
        for seq, K in zip(seqs, ks):
            nc = seq.num_computed
            pos = list(range(nc, nc + K + 1))
            items.append((seq, pos, [-1] * (K + 1), [seq.bonus] + [spec.mask_token_id] * K, nc))
        batch = _batch(items, self.device)
        ids = torch.tensor([t for *_, ids, _ in items for t in ids], device=self.device)
        hidden = self.draft.model(self.lm.model.embed_tokens(ids), batch.positions, self.draft_attn(self.pool, batch))
        qs = batch.query_start
        draft_rows = torch.tensor([r for i in range(len(seqs)) for r in range(qs[i] + 1, qs[i + 1])], device=self.device)
        logits = self.draft.model.compute_logits(hidden[draft_rows], self.lm.model.lm_head)
        off = 0
        for seq, K in zip(seqs, ks):
            lg = logits[off:off + K]
            off += K
            p = seq.params
            if spec.probabilistic_drafting and not p.greedy:
                q = processed_probs(lg, p.temperature, p.top_k, p.top_p)
                seq.drafts, seq.draft_probs = sample_from(q, seq.generator).tolist(), q
            else:
                seq.drafts, seq.draft_probs = lg.argmax(-1).tolist(), None
            seq.stats.num_draft_passes += 1
