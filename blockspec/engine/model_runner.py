"""Runs one engine step on the models: verify -> sample -> accept -> append context -> propose, on one of two paths
over the same stages (blockspec/speculative/step.py), same results:

- the decode step (engine/decode_step.py), when every scheduled request decodes with the same (K, K'): one
  static-shape function, replayed from a CUDA graph on GPU; with split_mixed a mixed step runs its decoding
  requests there and only the rest varlen;
- the varlen step, for any mix of prefill chunks and verify blocks: one target forward over every scheduled row,
  then sampling, acceptance, the proposer's context append and the next drafts on the device, and one
  device-to-host copy.

Either way the step returns, per request, the tokens committed and the next drafts (speculative/drafts.py): the
engine commits them and never asks which path ran. launch() hands a step to the device and collect() reads it;
a decode step can be continued on the device (launch_next) before it is read (overlap, engine/llm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.config import EngineConfig
from blockspec.engine.decode_step import DecodeStep, Launched
from blockspec.engine.observer import StepObserver
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, StepResult, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingRows, sample_rows
from blockspec.speculative.acceptance import AcceptancePolicy, accept_block
from blockspec.speculative.drafts import NO_DRAFTS, Drafts, sample_drafts
from blockspec.speculative.proposer import CommittedRows, DraftBatch, StepModels
from blockspec.speculative.step import verify


def _slots(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


@dataclass
class Pending:
    """A step handed to the device: a decode step still running (`launched`), or the results of one that has run."""

    seqs: list[Sequence]
    launched: Launched | None = None
    results: list[StepResult] | None = None

    @property
    def chain_k(self) -> int | None:
        """K when the step can be continued on the device with the same K (launch_next), else None."""
        L = self.launched
        return L.K if L is not None and L.K == L.next_k else None


class ModelRunner:
    def __init__(self, models: StepModels, acceptance: AcceptancePolicy, max_model_len: int, vocab_size: int,
                 config: EngineConfig) -> None:
        self.models, self.acceptance, self.vocab_size, self.max_model_len = models, acceptance, vocab_size, max_model_len
        self.device = models.pool.k.device
        self.split_mixed = config.split_mixed_steps
        capture = self.device.type == "cuda" and models.backend.capturable and not config.enforce_eager
        self.decode = DecodeStep(models, acceptance, config.max_num_seqs, max_model_len, vocab_size, capture)
        self.observer = StepObserver()

    def observe(self, observer: StepObserver) -> None:
        self.observer = self.decode.observer = observer

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return host_tensor(values, dtype, self.device)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq]) -> Pending:
        """Hand the step to the device: the decode step is enqueued without waiting for it; any other step runs."""
        seqs = [s.seq for s in scheduled]
        if self.decode.eligible(scheduled):
            return Pending(seqs, launched=self.decode.launch(scheduled))
        decoding, rest = self.decode.split(scheduled) if self.split_mixed else ([], scheduled)
        by_seq = {id(r.seq): r for r in self.decode.collect(self.decode.launch(decoding))} if decoding else {}
        if rest:
            with self.observer.stage("varlen"):
                by_seq.update((id(r.seq), r) for r in self.varlen_step(rest))
        return Pending(seqs, results=[by_seq[id(s)] for s in seqs])

    @torch.inference_mode()
    def launch_next(self, prev: Pending) -> Pending:
        """The next step of prev's requests, enqueued behind it on the device (prev.chain_k is not None)."""
        return Pending(prev.seqs, launched=self.decode.launch_next(prev.launched))

    def collect(self, pending: Pending) -> list[StepResult]:
        return pending.results if pending.launched is None else self.decode.collect(pending.launched)

    def step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        return self.collect(self.launch(scheduled))

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
            ids += seq.tokens[nc:nc + n] if s.is_prefill else [seq.bonus] + seq.drafts.tokens[:s.k]
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
        acc = _Accepted(self, scheduled, first_logit, qs, len(positions))
        acc.accept(out.logits, chosen)
        if self.models.proposer is not None:
            self.models.proposer.append_context(self.models, CommittedRows(
                token_ids, batch, torch.where(acc.keep, batch.slot_mapping, -1), out.taps))
        q = self._propose(scheduled, acc, batch.block_tables)
        host = torch.cat(acc.flat).tolist() if acc.flat else []  # the step's one device-to-host copy
        results = []
        for i, s in enumerate(scheduled):
            drafts = NO_DRAFTS
            if i in acc.drafts_at:
                at, k = acc.drafts_at[i]
                drafts = Drafts(host[at:at + k], q.get(i))
            if s.is_prefill:
                first = host[acc.where[i]:acc.where[i] + 1] if i in acc.where else []
                results.append(StepResult(s.seq, first, None, s.num_rows, drafts))
            else:
                K, at = s.k, acc.where[i]
                n = host[at + K + 1]
                results.append(StepResult(s.seq, host[at:at + n + 1], n, n + 1, drafts, K))
        return results

    @staticmethod
    def _samples_first(s: ScheduledSeq) -> bool:
        """Does this prefill chunk end the prompt of a sequence that has no token yet (so it samples token 1)?"""
        return s.seq.num_computed + s.num_rows == s.seq.prefill_len and not s.seq.output_ids

    def _propose(self, scheduled: list[ScheduledSeq], acc: _Accepted,
                 tables: torch.Tensor) -> dict[int, torch.Tensor]:
        """The next drafts of every request that asks for them, from its new bonus (on the device): one proposer pass
        per distinct K' (one in all but the rare steps where K' is clipped near the end of the context). Appends the
        drafts to acc.flat; returns the q of sampled drafts by request index."""
        proposer, q = self.models.proposer, {}
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(scheduled):
            if s.next_k > 0 and i in acc.bonus_at:
                groups.setdefault(s.next_k, []).append(i)
        if not groups:
            return q
        bonus, start = torch.cat(acc.bonus), torch.cat(acc.start)
        for K, idx in groups.items():
            B, R = len(idx), proposer.draft_rows(K)
            sel = self._tensor([acc.bonus_at[i] for i in idx])
            seqs = [scheduled[i].seq for i in idx]
            rows = SamplingRows.build([s.params for s in seqs], [s.seed for s in seqs], self.device, self.vocab_size)
            sample = proposer.probabilistic and not rows.all_greedy
            batch = DraftBatch(bonus[sel], start[sel], tables[self._tensor(idx)],
                               self._tensor([j * R for j in range(B + 1)], torch.int32), K, R,
                               max(s.num_computed + scheduled[i].num_rows for i, s in zip(idx, seqs)),
                               rows if sample else None)
            proposal = proposer.propose(self.models, batch, want_logits=sample)
            drafts = proposal.drafts
            if sample:
                drafts, probs = ((drafts, proposal.q) if proposal.q is not None
                                 else sample_drafts(proposal.logits, drafts, rows, batch.start))
                q.update((i, probs[j]) for j, i in enumerate(idx) if not seqs[j].params.greedy)
            at = sum(t.numel() for t in acc.flat)
            acc.drafts_at.update((i, (at + j * K, K)) for j, i in enumerate(idx))
            acc.flat.append(drafts.flatten())
        return q


class _Accepted:
    """The acceptance stage of a varlen step, batched per K (per-request ops would make a step cost O(batch) kernel
    launches). Fills: flat (device results for the one host copy: first tokens of prefills, per verify block its K+1
    emitted slots then n), where (each request's offset in them), keep (which rows' context to keep: prefill rows, and
    verify rows up to the last committed one), and each new bonus and its position on the device (bonus, start,
    bonus_at: a request's index in their concatenation) for the propose stage."""

    def __init__(self, runner: ModelRunner, scheduled: list[ScheduledSeq], first_logit: list[int], qs: list[int],
                 num_rows: int) -> None:
        self.r, self.scheduled, self.first_logit, self.qs = runner, scheduled, first_logit, qs
        self.flat: list[torch.Tensor] = []
        self.where: dict[int, int] = {}
        self.keep = torch.ones(num_rows, dtype=torch.bool, device=runner.device)
        self.bonus: list[torch.Tensor] = []
        self.start: list[torch.Tensor] = []
        self.bonus_at: dict[int, int] = {}
        self.drafts_at: dict[int, tuple[int, int]] = {}  # request index -> (offset in the host copy, K')

    def _new_bonus(self, idx: list[int], bonus: torch.Tensor, start: torch.Tensor) -> None:
        base = sum(t.numel() for t in self.bonus)
        self.bonus_at.update((i, base + j) for j, i in enumerate(idx))
        self.bonus.append(bonus)
        self.start.append(start)

    def accept(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        r, scheduled, t = self.r, self.scheduled, self.r._tensor
        firsts = [i for i, s in enumerate(scheduled) if s.is_prefill and r._samples_first(s)]
        if firsts:
            first = chosen[t([self.first_logit[i] for i in firsts])]
            self.flat.append(first)
            self.where.update((i, j) for j, i in enumerate(firsts))
            self._new_bonus(firsts, first, t([scheduled[i].seq.num_computed + scheduled[i].num_rows for i in firsts]))
        # a resumed request (preempted after its first token) whose prefill ends: its bonus is known on the host
        resumed = [i for i, s in enumerate(scheduled) if s.is_prefill and s.next_k > 0 and i not in self.where
                   and s.seq.num_computed + s.num_rows == s.seq.prefill_len]
        if resumed:
            self._new_bonus(resumed, t([scheduled[i].seq.bonus for i in resumed]),
                            t([scheduled[i].seq.prefill_len for i in resumed]))
        off = len(firsts)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(scheduled):
            if not s.is_prefill:
                groups.setdefault(s.k, []).append(i)
        for K, idx in groups.items():
            offs = torch.arange(K + 1, device=r.device)
            seqs = [scheduled[i].seq for i in idx]
            drafts = t([s.drafts.tokens[:K] for s in seqs]).view(len(idx), K)
            at = t([self.first_logit[i] for i in idx])[:, None] + offs
            rows = SamplingRows.build([s.params for s in seqs], [s.seed for s in seqs], r.device, r.vocab_size)
            start = t([s.num_computed for s in seqs])
            sampled = [s.drafts.probs for s in seqs if s.drafts.probs is not None and K > 0]
            q = torch.stack([s.drafts.probs[:K] if s.drafts.probs is not None else torch.zeros_like(sampled[0][:K])
                             for s in seqs]) if sampled else None
            tokens, n = accept_block(r.acceptance, drafts, chosen[at], rows, start, q, logits[at] if sampled else None)
            self.flat.append(torch.cat([tokens, n[:, None]], dim=1).flatten())
            self.keep[(t([self.qs[i] for i in idx])[:, None] + offs).flatten()] = (offs[None] <= n[:, None]).flatten()
            self.where.update((i, off + j * (K + 2)) for j, i in enumerate(idx))
            off += len(idx) * (K + 2)
            self._new_bonus(idx, tokens.gather(1, n[:, None])[:, 0], start + n + 1)
