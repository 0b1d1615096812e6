"""Runs one engine step on the models. Two paths over the same stages (blockspec/speculative/step.py), same results:

- the varlen step, for any mix of prefill chunks and verify blocks: one target forward over every scheduled row,
  then sampling, acceptance and the proposer's context append on device, and one device-to-host copy; the engine
  drafts the next blocks afterwards with propose();
- the decode step (engine/decode_step.py), when every scheduled request is decoding with the same K: verify,
  accept, context append AND the next drafts in one static-shape function, replayed from a CUDA graph on GPU;
  with split_mixed a mixed step runs its decoding requests there and only the rest varlen.

Returns, per sequence, the tokens committed this step; the engine does stop checks and bookkeeping."""

from __future__ import annotations

import torch

from blockspec import rng
from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.decode_step import DecodeStep, Launched
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, StepResult, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingRows, processed_probs_rows, race, sample_rows
from blockspec.speculative.acceptance import AcceptancePolicy, accept_sampled_drafts
from blockspec.speculative.proposer import CommittedRows, DraftBatch, StepModels
from blockspec.speculative.step import verify


def _slots(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class ModelRunner:
    def __init__(self, models: StepModels, acceptance: AcceptancePolicy, max_model_len: int, vocab_size: int,
                 enforce_eager: bool = False, max_num_seqs: int = 32, split_mixed: bool = False) -> None:
        self.models, self.acceptance, self.vocab_size, self.max_model_len = models, acceptance, vocab_size, max_model_len
        self.device = models.pool.k.device
        self.split_mixed = split_mixed  # EngineConfig.split_mixed_steps
        capture = self.device.type == "cuda" and models.backend.capturable and not enforce_eager
        self.decode = DecodeStep(models, acceptance, max_num_seqs, max_model_len, vocab_size, capture)

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return host_tensor(values, dtype, self.device)

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        K = self.decode.eligible(scheduled)
        if K is not None:
            return self.decode.run([s.seq for s in scheduled], K)
        decoding, rest = self.decode.split(scheduled) if self.split_mixed else ([], scheduled)
        if not decoding:
            return self.varlen_step(scheduled)
        by_seq = {id(r.seq): r for r in self.decode.run([s.seq for s in decoding], len(decoding[0].seq.drafts))}
        if rest:
            by_seq.update((id(r.seq), r) for r in self.varlen_step(rest))
        return [by_seq[id(s.seq)] for s in scheduled]

    @torch.inference_mode()
    def launch_decode(self, scheduled: list[ScheduledSeq]) -> Launched | None:
        """Enqueue the step without waiting for it, when the decode step takes every scheduled request (the
        overlapped path); None otherwise."""
        K = self.decode.eligible(scheduled)
        return self.decode.launch([s.seq for s in scheduled], K) if K is not None else None

    @torch.inference_mode()
    def launch_next(self, prev: Launched) -> Launched:
        return self.decode.launch_next(prev)

    def collect(self, launched: Launched) -> list[StepResult]:
        return self.decode.collect(launched)

    def varlen_step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        bs = self.models.pool.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qs, kv_lens = [0], []
        logit_rows: list[int] = []
        sample_pos: list[int] = []
        params, seeds = [], []
        first_logit: list[int] = []  # per scheduled request: its first logit row (its rows are consecutive)
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
                rows = [n - 1] if self._samples_first(s) else []
            first_logit.append(len(logit_rows))
            logit_rows += [row0 + r for r in rows]
            sample_pos += [nc + r + 1 for r in rows]  # the position of the token each row samples
            params += [seq.params] * len(rows)
            seeds += [seq.seed] * len(rows)
        width = max(len(s.seq.block_table) for s in scheduled)
        batch = PagedBatch(self._tensor(positions), self._tensor(slots), self._tensor(qs, torch.int32),
                           self._tensor(kv_lens, torch.int32), block_tables([s.seq for s in scheduled], width, self.device),
                           max(b - a for a, b in zip(qs, qs[1:])), max(kv_lens))
        token_ids = self._tensor(ids)
        out = verify(self.models, token_ids, batch, self._tensor(logit_rows))
        chosen = sample_rows(out.logits, SamplingRows.build(params, seeds, self.device, self.vocab_size),
                             self._tensor(sample_pos))
        flat, where, keep = self._accept_all(scheduled, first_logit, qs, out.logits, chosen, len(positions))
        if self.models.proposer is not None:
            self.models.proposer.append_context(self.models, CommittedRows(
                token_ids, batch, torch.where(keep, batch.slot_mapping, -1), out.taps))
        host = torch.cat(flat).tolist() if flat else []  # the step's one device-to-host copy
        results = []
        for i, s in enumerate(scheduled):
            if s.is_prefill:
                results.append(StepResult(s.seq, host[where[i]:where[i] + 1] if i in where else [], None, s.num_rows))
            else:
                K, at = len(s.seq.drafts), where[i]
                n = host[at + K + 1]
                results.append(StepResult(s.seq, host[at:at + n + 1], n, n + 1))
        return results

    @staticmethod
    def _samples_first(s: ScheduledSeq) -> bool:
        """Does this prefill chunk end the prompt of a sequence that has no token yet (so it samples token 1)?"""
        return s.seq.num_computed + s.num_rows == s.seq.prefill_len and not s.seq.output_ids

    def _accept_all(self, scheduled: list[ScheduledSeq], first_logit: list[int], qs: list[int], logits: torch.Tensor,
                    chosen: torch.Tensor, num_rows: int) -> tuple[list[torch.Tensor], dict[int, int], torch.Tensor]:
        """Acceptance of every verify block, batched per K (per-request ops would make a step cost O(batch) kernel
        launches); p/q rejection (probabilistic drafting) per request. Returns the flat device results (first tokens
        of prefills; per verify block its K+1 emitted slots then n), each request's offset in them, and which rows'
        context to keep (prefill rows, and verify rows up to the last committed one)."""
        dev = self.device
        flat: list[torch.Tensor] = []
        where: dict[int, int] = {}
        keep = torch.ones(num_rows, dtype=torch.bool, device=dev)
        firsts = [i for i, s in enumerate(scheduled) if s.is_prefill and self._samples_first(s)]
        if firsts:
            flat.append(chosen[self._tensor([first_logit[i] for i in firsts])])
            where.update((i, j) for j, i in enumerate(firsts))
        off = len(firsts)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(scheduled):
            if not s.is_prefill and s.seq.draft_probs is None:
                groups.setdefault(len(s.seq.drafts), []).append(i)
        for K, idx in groups.items():
            offs = torch.arange(K + 1, device=dev)
            seqs = [scheduled[i].seq for i in idx]
            drafts = self._tensor([s.drafts for s in seqs]).view(len(idx), K)
            picked = chosen[self._tensor([first_logit[i] for i in idx])[:, None] + offs]
            tokens, n = self.acceptance.accept(drafts, picked, self._tensor([s.seed for s in seqs]),
                                               self._tensor([s.num_computed for s in seqs]))
            flat.append(torch.cat([tokens, n[:, None]], dim=1).flatten())
            keep[(self._tensor([qs[i] for i in idx])[:, None] + offs).flatten()] = (offs[None] <= n[:, None]).flatten()
            where.update((i, off + j * (K + 2)) for j, i in enumerate(idx))
            off += len(idx) * (K + 2)
        for i, s in enumerate(scheduled):
            seq = s.seq
            if not s.is_prefill and seq.draft_probs is not None:
                K, li = len(seq.drafts), first_logit[i]
                rows = SamplingRows.build([seq.params] * (K + 1), [seq.seed] * (K + 1), dev, self.vocab_size)
                tokens, n = accept_sampled_drafts(self._tensor(seq.drafts), seq.draft_probs[:K], logits[li:li + K + 1],
                                                  rows, seq.num_computed)
                flat.append(torch.cat([tokens, n]))
                keep[qs[i]:qs[i] + K + 1] = torch.arange(K + 1, device=dev) <= n
                where[i] = off
                off += K + 2
        return flat, where, keep

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft the next block of each sequence from its bonus (context = everything before it): one proposer
        pass per distinct K (one in all but the rare steps where K is clipped near max_model_len)."""
        proposer = self.models.proposer
        groups: dict[int, list[Sequence]] = {}
        for seq, K in zip(seqs, ks):
            groups.setdefault(K, []).append(seq)
        for K, group in groups.items():
            B, R = len(group), proposer.draft_rows(K)
            starts = [s.num_computed for s in group]
            batch = DraftBatch(self._tensor([s.bonus for s in group]), self._tensor(starts),
                               block_tables(group, max(len(s.block_table) for s in group), self.device),
                               self._tensor([i * R for i in range(B + 1)], torch.int32), K, R, max(starts))
            proposal = proposer.propose(self.models, batch, want_logits=proposer.probabilistic)
            drafts = proposal.drafts
            for i, seq in enumerate(group):
                seq.draft_probs = None
                if proposal.logits is not None and not seq.params.greedy:  # sampled drafts: per request
                    rows = SamplingRows.build([seq.params] * K, [seq.seed] * K, self.device, self.vocab_size)
                    q = processed_probs_rows(proposal.logits[i], rows)
                    noise = rng.exponential(rows.seeds, torch.arange(starts[i] + 1, starts[i] + K + 1, device=self.device),
                                            rng.STREAM_DRAFT, q.shape[-1])
                    drafts[i] = race(q, noise)
                    seq.draft_probs = q
                seq.stats.num_draft_passes += 1
            for seq, d in zip(group, drafts.tolist()):  # one device-to-host copy per group
                seq.drafts = d
