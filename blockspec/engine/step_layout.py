"""The host side of one engine step, laid out once from its scheduled requests and read by both step paths.

StepLayout says, per request, which tokens its rows feed the target (input_ids), where its rows start (start), and
where its results sit in the step's one device-to-host copy (tokens_at, drafts_at); `results` reads that copy back
into StepResults. The decode step (engine/decode_step.py) lays out B requests of one (K, K'), each a row of its
packed [B, K+2+K'] result; its graph derives every row's position and slot on the device. The varlen step
(engine/varlen_step.py) also needs every row's position and slot, the logit rows it samples, and its requests
grouped for batched stages: VarlenLayout, whose index lists go to the device in one copy (HostPack)."""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import StepResult
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingParams, SamplingRows
from blockspec.speculative.drafts import NO_DRAFTS, Drafts


@dataclass(frozen=True)
class Span:
    """One list's place in a step's host-to-device copy; `of(dev)` is its view on the device."""

    start: int
    shape: tuple[int, ...]

    def of(self, dev: torch.Tensor) -> torch.Tensor:
        flat = dev[self.start:self.start + math.prod(self.shape)]
        return flat if len(self.shape) == 1 else flat.view(self.shape)


class HostPack:
    """int64 lists gathered into one host-to-device copy (a tensor per list would cost a copy each)."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def add(self, values: list[int], *shape: int) -> Span:
        span = Span(len(self.values), shape or (len(values),))
        self.values += values
        return span

    def index(self, index: list[int], num_requests: int) -> Span | None:
        """A list of request places; None when it is every request of the step in order (nothing to select)."""
        return None if index == list(range(num_requests)) else self.add(index)

    def upload(self, device: torch.device) -> torch.Tensor:
        return host_tensor(self.values, torch.long, device)


@dataclass
class VerifyGroup:
    """The verify blocks of one K: one batched accept."""

    K: int
    index: list[int]  # [G] the requests (their places in the step)
    flags: dict[str, bool]  # their sampling rows' flags (SamplingRows.select)
    request: Span | None  # [G] index, on the device (None: every request of the step, in order)
    drafts: Span  # [G, K] d_1..d_K that each verifies
    logit_row: Span  # [G] the logit row of each bonus (its drafts' rows follow it)
    row: Span  # [G] the forward row of each bonus
    start: Span  # [G] each bonus's position


@dataclass
class ProposeGroup:
    """The requests proposing K' drafts from their new bonus: one proposer pass."""

    K: int  # K'
    index: list[int]  # [G]
    flags: dict[str, bool]
    request: Span | None  # [G] index, on the device (sampling rows, block tables; None: every request, in order)
    bonus: Span  # [G] each request's place in the step's vector of new bonuses
    max_kv_len: int  # host bound for the reference attention


@dataclass
class VarlenLayout:
    """The varlen step's rows (T of them, over B requests) and groups, its index lists in one HostPack.

    New bonuses (what the propose stage drafts from) are, in this order: the first tokens sampled by prefills that
    end (firsts), the known bonuses of preempted requests whose re-prefill ends (resumed), then each verify group's.
    The host copy holds, in this order: the firsts' tokens, each verify group's results, each propose group's drafts."""

    pack: HostPack
    input_ids: Span  # [T]
    positions: Span  # [T]
    slots: Span  # [T]
    query_start: Span  # [B+1] row offsets
    kv_lens: Span  # [B]
    max_query_len: int
    max_kv_len: int
    logit_rows: Span  # [L] the forward rows whose logits are read
    sample_pos: Span  # [L] the position of the token each samples
    logit_request: Span | None  # [L] the request of each (its sampling row; None: one row per request, in order)
    logit_flags: dict[str, bool]
    firsts: Span  # [F] logit rows of the prefills sampling their first token
    resumed: Span  # [R] the bonuses of the resumed requests
    prefill_start: Span  # [F+R] the position of the firsts' and the resumed requests' bonus (their prompt's end)
    verify: list[VerifyGroup] = field(default_factory=list)
    propose: list[ProposeGroup] = field(default_factory=list)
    # a hybrid target's recurrent state: the row offsets on the host (its grouping needs no device sync), which
    # requests verify drafts (their rows' inputs are kept for the commit) and each request's state slot
    row_starts: list[int] = field(default_factory=list)  # [B+1]
    keep: list[bool] = field(default_factory=list)  # [B]
    state_slots: Span | None = None  # [B]; None: the requests hold no state slots (a target without state)


def _groups(keys: list[int | None]) -> dict[int, list[int]]:
    """Places by their key, keys in order of first appearance (None: in no group)."""
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            groups.setdefault(k, []).append(i)
    return groups


def row_tokens(s: ScheduledSeq) -> list[int]:
    """The tokens of a request's rows this step: its prefill chunk, or its bonus and the k drafts it verifies."""
    seq, nc = s.seq, s.seq.num_computed
    return seq.tokens[nc:nc + s.num_rows] if s.is_prefill else [seq.bonus, *seq.drafts.tokens[:s.k]]


def samples_first(s: ScheduledSeq) -> bool:
    """Does this prefill chunk end the prompt of a sequence that has no token yet (so it samples token 1)?"""
    return s.is_prefill and s.seq.num_computed + s.num_rows == s.seq.prefill_len and not s.seq.output_ids


@dataclass
class StepLayout:
    scheduled: list[ScheduledSeq]
    input_ids: list[int]  # [T] every request's rows in turn (row_tokens)
    start: list[int]  # [B] the position of each request's first row (= its tokens already in the KV)
    tokens_at: Seq[int]  # [B] its tokens in the host copy: K+1 emitted slots then n, a prefill's first token; -1: none
    drafts_at: Seq[int]  # [B] its K' next drafts in the host copy; -1: none proposed
    varlen: VarlenLayout | None = None  # the varlen step's rows and groups

    @classmethod
    def for_decode(cls, scheduled: list[ScheduledSeq]) -> StepLayout:
        """B decoding requests of one (K, K'): request i's results are row i of the packed [B, K+2+K'] result."""
        K, next_k = scheduled[0].k, scheduled[0].next_k
        width, end = K + 2 + next_k, len(scheduled) * (K + 2 + next_k)
        ids = [t for s in scheduled for t in (s.seq.bonus, *s.seq.drafts.tokens[:K])]
        return cls(scheduled, ids, [s.seq.num_computed for s in scheduled], range(0, end, width),
                   range(K + 2, end, width) if next_k else [-1] * len(scheduled))

    @classmethod
    def for_varlen(cls, scheduled: list[ScheduledSeq], block_size: int, vocab_size: int) -> StepLayout:
        """Any mix of prefill chunks and verify blocks, every row in one target forward: the rows, then the
        groups, each request's results placed as the groups fill the host copy."""
        B, pack = len(scheduled), HostPack()
        ids, positions, slots, start, query_start, kv_lens = [], [], [], [], [0], []
        logit_rows, sample_pos, logit_request, logit_params = [], [], [], []
        first_logit = []  # per request: its first logit row
        for i, s in enumerate(scheduled):
            seq, nc, n = s.seq, s.seq.num_computed, s.num_rows
            ids += row_tokens(s)
            positions += range(nc, nc + n)
            table = seq.block_table
            slots += [table[p // block_size] * block_size + p % block_size for p in range(nc, nc + n)]
            row0 = query_start[-1]
            query_start.append(row0 + n)
            kv_lens.append(nc + n)
            start.append(nc)
            # a verify block samples at every row; a prefill chunk at its last row if it ends a prompt with no token
            rows = range(n) if not s.is_prefill else range(n - 1, n) if samples_first(s) else range(0)
            first_logit.append(len(logit_rows))
            logit_rows += [row0 + r for r in rows]
            sample_pos += [nc + r + 1 for r in rows]  # the position of the token each row samples
            logit_request += [i] * len(rows)
            if rows:
                logit_params.append(seq.params)
        firsts = [i for i, s in enumerate(scheduled) if samples_first(s)]
        # a request preempted after its first token whose re-prefill ends: its bonus is known on the host
        resumed = [i for i, s in enumerate(scheduled) if s.is_prefill and s.next_k > 0 and not samples_first(s)
                   and s.seq.num_computed + s.num_rows == s.seq.prefill_len]
        tokens_at, drafts_at, bonus_at = [-1] * B, [-1] * B, [-1] * B
        for j, i in enumerate(firsts + resumed):
            bonus_at[i] = j
        for j, i in enumerate(firsts):
            tokens_at[i] = j
        layout = VarlenLayout(
            pack, pack.add(ids), pack.add(positions), pack.add(slots), pack.add(query_start), pack.add(kv_lens),
            max(b - a for a, b in zip(query_start, query_start[1:])), max(kv_lens), pack.add(logit_rows),
            pack.add(sample_pos), pack.index(logit_request, B), SamplingRows.flags(logit_params, vocab_size),
            pack.add([first_logit[i] for i in firsts]), pack.add([scheduled[i].seq.bonus for i in resumed]),
            pack.add([kv_lens[i] for i in firsts + resumed]), row_starts=query_start,
            keep=[not s.is_prefill and s.k > 0 for s in scheduled])
        if scheduled[0].seq.state_slot >= 0:
            layout.state_slots = pack.add([s.seq.state_slot for s in scheduled])
        host_at, bonuses = len(firsts), len(firsts) + len(resumed)
        for K, idx in _groups([None if s.is_prefill else s.k for s in scheduled]).items():
            seqs = [scheduled[i].seq for i in idx]
            layout.verify.append(VerifyGroup(
                K, idx, SamplingRows.flags([s.params for s in seqs], vocab_size), pack.index(idx, B),
                pack.add([t for s in seqs for t in s.drafts.tokens[:K]], len(idx), K),
                pack.add([first_logit[i] for i in idx]), pack.add([query_start[i] for i in idx]),
                pack.add([start[i] for i in idx])))
            for j, i in enumerate(idx):
                tokens_at[i], bonus_at[i] = host_at + j * (K + 2), bonuses + j
            host_at, bonuses = host_at + len(idx) * (K + 2), bonuses + len(idx)
        # every request with a new bonus proposes its K' drafts (none while its prefill goes on)
        for K, idx in _groups([s.next_k if s.next_k and bonus_at[i] >= 0 else None
                               for i, s in enumerate(scheduled)]).items():
            layout.propose.append(ProposeGroup(
                K, idx, SamplingRows.flags([scheduled[i].seq.params for i in idx], vocab_size), pack.index(idx, B),
                pack.add([bonus_at[i] for i in idx]), max(kv_lens[i] for i in idx)))
            for j, i in enumerate(idx):
                drafts_at[i] = host_at + j * K
            host_at += len(idx) * K
        return cls(scheduled, ids, start, tokens_at, drafts_at, layout)

    def sampling_rows(self, device: torch.device, vocab_size: int, pad: int = 0) -> SamplingRows:
        """One row per request (then `pad` greedy rows): the step's sampling rows, built once."""
        seqs = [s.seq for s in self.scheduled]
        return SamplingRows.build([s.params for s in seqs] + [SamplingParams()] * pad,
                                  [s.seed for s in seqs] + [0] * pad, device, vocab_size)

    def results(self, host: list[int], q: dict[int, torch.Tensor] | torch.Tensor | None) -> list[StepResult]:
        """The step's host copy read per request. q: the next drafts' distributions (sampled drafts), by request
        (or [B, K', V] in request order); a greedy request's drafts carry none."""
        out = []
        by_request = q.get if type(q) is dict else q.__getitem__ if q is not None else None
        for i, (s, at, dat) in enumerate(zip(self.scheduled, self.tokens_at, self.drafts_at)):
            seq = s.seq
            drafts = NO_DRAFTS
            if dat >= 0:
                probs = None if by_request is None or seq.params.greedy else by_request(i)
                drafts = Drafts(host[dat:dat + s.next_k], probs)
            if s.is_prefill:
                out.append(StepResult(seq, host[at:at + 1] if at >= 0 else [], None, s.num_rows, drafts))
            else:
                k = s.num_rows - 1
                n = host[at + k + 1]
                out.append(StepResult(seq, host[at:at + n + 1], n, n + 1, drafts, k))
        return out
