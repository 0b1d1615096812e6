"""Runs one engine step on the models. Two paths, same results:

- the varlen step, for any mix of prefill chunks and verify blocks: one target forward over every scheduled row,
  then sampling, acceptance and the draft-context append on device, and one device-to-host copy; the engine drafts
  the next blocks afterwards with propose();
- the decode step (engine/decode_step.py), when every scheduled request is decoding with the same K: verify,
  accept, context append AND the next drafts in one static-shape function, replayed from a CUDA graph on GPU.

Returns, per sequence, the tokens committed this step; the engine does stop checks and bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec import rng
from blockspec.attention.backends import get_backend
from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.decode_step import DecodeStep
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.kv.pool import KVPool
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingRows, processed_probs_rows, race, sample_rows
from blockspec.spec.verify import accept_probabilistic, accept_tokens


@dataclass
class StepResult:
    seq: Sequence
    new_tokens: list[int]  # tokens committed this step (before stop/max_tokens cuts)
    num_accepted: int | None  # drafts accepted (verify rows only)
    num_kv_rows: int  # rows whose target KV + draft context became valid this step
    next_drafts: list[int] | None = None  # the next block's drafts, when the step drafted them already


def block_tables(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] int64 block tables, padded with block 0 (read-only padding: its rows never write)."""
    tables = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    return tables.to(device)


def _slots(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class ModelRunner:
    def __init__(self, lm: LoadedModel, draft: LoadedDraft | None, pool: KVPool, max_model_len: int,
                 attention_backend: str = "auto", enforce_eager: bool = False, max_num_seqs: int = 32) -> None:
        self.lm, self.draft, self.pool = lm, draft, pool
        self.device = next(lm.model.parameters()).device
        self.backend = get_backend(attention_backend, self.device)
        self.taps = draft.spec.target_layer_ids if draft is not None else []
        self.max_model_len = max_model_len
        self.vocab_size = lm.config.vocab_size
        capture = self.device.type == "cuda" and self.backend.capturable and not enforce_eager
        self.decode = DecodeStep(self, max_num_seqs, capture)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        K = self.decode.eligible(scheduled)
        if K is not None:
            return self.decode.run([s.seq for s in scheduled], K)
        return self._varlen_step(scheduled)

    def _varlen_step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        bs = self.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qs, kv_lens = [0], []
        logit_rows: list[int] = []
        sample_pos: list[int] = []
        params, seeds = [], []
        first_token: list[bool] = []  # per scheduled prefill: does this chunk end the prompt and sample token 1?
        for s in scheduled:
            seq, nc, n = s.seq, s.seq.num_computed, s.num_rows
            ids += seq.tokens[nc:nc + n] if s.is_prefill else [seq.bonus] + seq.drafts
            positions += range(nc, nc + n)
            slots += _slots(seq, nc, n, bs)
            row0 = qs[-1]
            qs.append(row0 + n)
            kv_lens.append(nc + n)
            if not s.is_prefill:
                rows = list(range(n))
            else:  # the prompt's last row samples the first token (a resumed sequence already has it)
                first_token.append(nc + n == seq.prefill_len and not seq.output_ids)
                rows = [n - 1] if first_token[-1] else []
            logit_rows += [row0 + r for r in rows]
            sample_pos += [nc + r + 1 for r in rows]  # the position of the token each row samples
            params += [seq.params] * len(rows)
            seeds += [seq.seed] * len(rows)
        width = max(len(s.seq.block_table) for s in scheduled)
        batch = PagedBatch(self._tensor(positions), self._tensor(slots), self._tensor(qs, torch.int32),
                           self._tensor(kv_lens, torch.int32), block_tables([s.seq for s in scheduled], width, self.device),
                           max(b - a for a, b in zip(qs, qs[1:])), max(kv_lens))
        out = self.lm.model(self._tensor(ids), batch.positions, self.backend.target(self.pool, batch),
                            tap_layers=self.taps, logit_rows=self._tensor(logit_rows))
        chosen = sample_rows(out.logits, SamplingRows.build(params, seeds, self.device, self.vocab_size),
                             self._tensor(sample_pos))
        pieces, keep, li = [], [], 0
        firsts = iter(first_token)
        for s in scheduled:
            seq = s.seq
            if s.is_prefill:
                if next(firsts):
                    pieces.append(chosen[li:li + 1])
                    li += 1
                keep.append(torch.ones(s.num_rows, dtype=torch.bool, device=self.device))
                continue
            K = len(seq.drafts)
            drafts = self._tensor(seq.drafts)[None]
            if seq.draft_probs is not None:
                tokens, n = self._accept_probabilistic(seq, drafts, out.logits[li:li + K + 1])
            else:
                tokens, n = accept_tokens(drafts, chosen[li:li + K + 1][None])
            li += K + 1
            pieces += [tokens[0], n]
            keep.append(torch.arange(K + 1, device=self.device) <= n)
        if self.draft is not None:
            ctx_slots = torch.where(torch.cat(keep), batch.slot_mapping, -1)
            self._append_context(out.taps, batch.positions, ctx_slots)
        host = torch.cat(pieces).tolist() if pieces else []  # the step's one device-to-host copy
        return self._results(scheduled, first_token, host)

    @staticmethod
    def _results(scheduled: list[ScheduledSeq], first_token: list[bool], host: list[int]) -> list[StepResult]:
        results, i = [], 0
        firsts = iter(first_token)
        for s in scheduled:
            seq = s.seq
            if s.is_prefill:
                first = next(firsts)
                results.append(StepResult(seq, host[i:i + 1] if first else [], None, s.num_rows))
                i += 1 if first else 0
                continue
            K = len(seq.drafts)
            tokens, n = host[i:i + K + 1], host[i + K + 1]
            i += K + 2
            results.append(StepResult(seq, tokens[: n + 1], n, n + 1))
        return results

    def _accept_probabilistic(self, seq: Sequence, drafts: torch.Tensor, logits: torch.Tensor):
        """p/q rejection for sampled drafts; noise keyed by the draft positions (uniforms) and the block start."""
        K, nc = drafts.shape[1], seq.num_computed
        rows = SamplingRows.build([seq.params] * (K + 1), [seq.seed] * (K + 1), self.device, self.vocab_size)
        probs = processed_probs_rows(logits, rows)
        seed = rows.seeds[:1]
        u = rng.uniform(seed.expand(K), torch.arange(nc + 1, nc + K + 1, device=self.device), rng.STREAM_ACCEPT, 1)
        noise = rng.exponential(seed, self._tensor([nc]), rng.STREAM_RESIDUAL, probs.shape[-1])
        return accept_probabilistic(drafts, probs[None], seq.draft_probs[None, :K], u.T, noise)

    def _append_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write draft-context K/V of committed rows into the draft pages (same slots as their target KV; -1 skips)."""
        for layer, (k, v) in enumerate(self.draft.model.context_kv(taps, positions)):
            self.backend.store(self.pool.draft_k[layer], self.pool.draft_v[layer], k, v, slots)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft the next block for each sequence from its bonus (context = everything before it), in one pass."""
        spec = self.draft.spec
        ids: list[int] = []
        positions: list[int] = []
        qs, kv_lens = [0], []
        for seq, K in zip(seqs, ks):
            nc = seq.num_computed
            ids += [seq.bonus] + [spec.mask_token_id] * K
            positions += range(nc, nc + K + 1)
            qs.append(qs[-1] + K + 1)
            kv_lens.append(nc)
        width = max(len(s.block_table) for s in seqs)
        batch = PagedBatch(self._tensor(positions), self._tensor([-1] * len(ids)), self._tensor(qs, torch.int32),
                           self._tensor(kv_lens, torch.int32), block_tables(seqs, width, self.device),
                           max(ks) + 1, max(kv_lens))
        hidden = self.draft.model(self.lm.model.embed_tokens(self._tensor(ids)), batch.positions,
                                  self.backend.draft(self.pool, batch))
        draft_rows = self._tensor([r for i in range(len(seqs)) for r in range(qs[i] + 1, qs[i + 1])])
        logits = self.draft.model.compute_logits(hidden[draft_rows], self.lm.model.lm_head)
        chosen, off = [], 0
        for i, (seq, K) in enumerate(zip(seqs, ks)):
            lg = logits[off:off + K]
            off += K
            seq.draft_probs = None
            if spec.probabilistic_drafting and not seq.params.greedy:
                rows = SamplingRows.build([seq.params] * K, [seq.seed] * K, self.device, self.vocab_size)
                q = processed_probs_rows(lg, rows)
                draft_positions = batch.positions[qs[i] + 1:qs[i + 1]]
                noise = rng.exponential(rows.seeds, draft_positions, rng.STREAM_DRAFT, q.shape[-1])
                chosen.append(race(q, noise))
                seq.draft_probs = q
            else:
                chosen.append(lg.argmax(-1))
            seq.stats.num_draft_passes += 1
        host = torch.cat(chosen).tolist()  # one device-to-host copy for every block
        off = 0
        for seq, K in zip(seqs, ks):
            seq.drafts = host[off:off + K]
            off += K
