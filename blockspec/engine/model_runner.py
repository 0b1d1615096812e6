"""Runs one engine step on the models. Two paths, same results:

- the varlen step, for any mix of prefill chunks and verify blocks: one target forward over every scheduled row,
  then sampling, acceptance and the draft-context append on device, and one device-to-host copy; the engine drafts
  the next blocks afterwards with propose();
- the decode step (engine/decode_step.py), when every scheduled request is decoding with the same K: verify,
  accept, context append AND the next drafts in one static-shape function, replayed from a CUDA graph on GPU;
  with EngineConfig.split_mixed_steps a mixed step runs its decoding requests here and only the rest varlen.

Returns, per sequence, the tokens committed this step; the engine does stop checks and bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec import rng
from blockspec.attention.backends import get_backend
from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.decode_step import DecodeStep, forced_accept
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.kv.pool import KVPool
from blockspec.layers import kernels
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingRows, processed_probs_rows, race, sample_rows
from blockspec.speculative.verify import accept_probabilistic, accept_tokens


@dataclass
class StepResult:
    seq: Sequence
    new_tokens: list[int]  # tokens committed this step (before stop/max_tokens cuts)
    num_accepted: int | None  # drafts accepted (verify rows only)
    num_kv_rows: int  # rows whose target KV + draft context became valid this step
    next_drafts: list[int] | None = None  # the next block's drafts, when the step drafted them already


def _slots(seq: Sequence, start: int, n: int, block_size: int) -> list[int]:
    return [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class ModelRunner:
    def __init__(self, lm: LoadedModel, draft: LoadedDraft | None, pool: KVPool, max_model_len: int,
                 attention_backend: str = "auto", enforce_eager: bool = False, max_num_seqs: int = 32) -> None:
        self.lm, self.draft, self.pool = lm, draft, pool
        self.device = next(lm.model.parameters()).device
        self.backend = get_backend(attention_backend, self.device, lm.batch_invariant)
        self.taps = draft.spec.target_layer_ids if draft is not None else []
        if draft is not None and kernels.fused_device(self.device):
            draft.model.fuse_qkv()  # one GEMM + one Triton prologue per draft layer (idempotent)
        self.max_model_len = max_model_len
        self.vocab_size = lm.config.vocab_size
        capture = self.device.type == "cuda" and self.backend.capturable and not enforce_eager
        self.decode = DecodeStep(self, max_num_seqs, capture)
        self.split_mixed = False  # EngineConfig.split_mixed_steps

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return host_tensor(values, dtype, self.device)

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        K = self.decode.eligible(scheduled)
        if K is not None:
            return self.decode.run([s.seq for s in scheduled], K)
        decoding, rest = self.decode.split(scheduled) if self.split_mixed else ([], scheduled)
        if not decoding:
            return self._varlen_step(scheduled)
        by_seq = {id(r.seq): r for r in self.decode.run([s.seq for s in decoding], len(decoding[0].seq.drafts))}
        if rest:
            by_seq.update((id(r.seq), r) for r in self._varlen_step(rest))
        return [by_seq[id(s.seq)] for s in scheduled]

    def _varlen_step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        bs = self.pool.block_size
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
        out = self.lm.model(self._tensor(ids), batch.positions, self.backend.target(self.pool, batch),
                            tap_layers=self.taps, logit_rows=self._tensor(logit_rows))
        chosen = sample_rows(out.logits, SamplingRows.build(params, seeds, self.device, self.vocab_size),
                             self._tensor(sample_pos))
        flat, where, keep = self._accept_all(scheduled, first_logit, qs, out.logits, chosen, len(positions))
        if self.draft is not None:
            self._append_context(out.taps, batch.positions, torch.where(keep, batch.slot_mapping, -1))
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
        draft context to keep (prefill rows, and verify rows up to the last committed one)."""
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
            drafts = self._tensor([scheduled[i].seq.drafts for i in idx]).view(len(idx), K)
            picked = chosen[self._tensor([first_logit[i] for i in idx])[:, None] + offs]
            tokens, n = accept_tokens(drafts, picked)
            if self.decode.forced_tau is not None:  # benchmark only, the same n as the decode step would force
                tokens, n = picked, forced_accept(self._tensor([scheduled[i].seq.seed for i in idx]),
                                                  self._tensor([scheduled[i].seq.num_computed for i in idx]), K,
                                                  self.decode.forced_tau)
            flat.append(torch.cat([tokens, n[:, None]], dim=1).flatten())
            keep[(self._tensor([qs[i] for i in idx])[:, None] + offs).flatten()] = (offs[None] <= n[:, None]).flatten()
            where.update((i, off + j * (K + 2)) for j, i in enumerate(idx))
            off += len(idx) * (K + 2)
        for i, s in enumerate(scheduled):
            if not s.is_prefill and s.seq.draft_probs is not None:
                K, li = len(s.seq.drafts), first_logit[i]
                tokens, n = self._accept_probabilistic(s.seq, self._tensor(s.seq.drafts)[None], logits[li:li + K + 1])
                flat.append(torch.cat([tokens[0], n]))
                keep[qs[i]:qs[i] + K + 1] = torch.arange(K + 1, device=dev) <= n
                where[i] = off
                off += K + 2
        return flat, where, keep

    def _accept_probabilistic(self, seq: Sequence, drafts: torch.Tensor,
                              logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        pool = self.pool
        kvs = self.draft.model.context_kv(taps, positions,
                                          lambda layer: (pool.draft_k[layer], pool.draft_v[layer], slots))
        for layer, (k, v) in enumerate(kvs):
            if k is not None and v is not None:  # None: the fused GPU prologue wrote them already
                self.backend.store(pool.draft_k[layer], pool.draft_v[layer], k, v, slots)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Draft the next block for each sequence from its bonus (context = everything before it), in one pass."""
        spec = self.draft.spec
        ids: list[int] = []
        positions: list[int] = []
        qs, kv_lens = [0], []
        for seq, K in zip(seqs, ks):
            nc, rows = seq.num_computed, spec.draft_rows(K)
            ids += [seq.bonus] + [spec.mask_token_id] * (rows - 1)
            positions += range(nc, nc + rows)
            qs.append(qs[-1] + rows)
            kv_lens.append(nc)
        width = max(len(s.block_table) for s in seqs)
        batch = PagedBatch(self._tensor(positions), self._tensor([-1] * len(ids)), self._tensor(qs, torch.int32),
                           self._tensor(kv_lens, torch.int32), block_tables(seqs, width, self.device),
                           max(spec.draft_rows(K) for K in ks), max(kv_lens))
        hidden = self.draft.model(self.lm.model.embed_tokens(self._tensor(ids)), batch.positions,
                                  self.backend.draft(self.pool, batch))
        draft_rows = self._tensor([r for i, K in enumerate(ks) for r in range(qs[i] + 1, qs[i] + 1 + K)])
        logits = None
        if spec.probabilistic_drafting:
            logits = self.draft.model.compute_logits(hidden[draft_rows], self.lm.model.lm_head)
            chosen = logits.max(-1).indices  # argmax drafts for every block at once (greedy requests keep them)
        else:  # the argmax head (over token ids < draft_vocab_size when set), as in the decode step
            chosen = self.draft.model.greedy_drafts(hidden[draft_rows], self.lm.model.lm_head)
        off = 0
        for i, (seq, K) in enumerate(zip(seqs, ks)):
            seq.draft_probs = None
            if logits is not None and not seq.params.greedy:  # sampled drafts: per request
                rows = SamplingRows.build([seq.params] * K, [seq.seed] * K, self.device, self.vocab_size)
                q = processed_probs_rows(logits[off:off + K], rows)
                noise = rng.exponential(rows.seeds, batch.positions[qs[i] + 1:qs[i] + 1 + K], rng.STREAM_DRAFT,
                                        q.shape[-1])
                chosen[off:off + K] = race(q, noise)
                seq.draft_probs = q
            off += K
            seq.stats.num_draft_passes += 1
        host = chosen.tolist()  # one device-to-host copy for every block
        off = 0
        for seq, K in zip(seqs, ks):
            seq.drafts = host[off:off + K]
            off += K
