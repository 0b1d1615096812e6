"""Continuous batching: which requests run this step, with how many new tokens each.

Every step the running decodes go first (each needs 1 + K rows, the bonus and its drafts, and KV slots for them;
the next draft block needs none, its K/V are never stored), then unfinished prefills, then waiting requests, chunked to fit the token budget. When the pool runs out of
blocks the newest running request is preempted: its blocks are released (full committed blocks stay in the prefix
cache) and it re-enters the waiting queue at the front, to be recomputed later with unchanged output.

Each scheduled request also gets the number of drafts its step proposes for the step after (the draft length
schedule's K at this batch size, clipped near the end of the context): every step proposes, on every path.

A hybrid target's sequence also holds a recurrent-state slot (kv/state_slots.py) while it runs: taken on admission,
given back when it finishes or is preempted (the recompute starts from position 0, from a zero state).

Under overlap (engine/llm_engine.py) the scheduler also decides whether the step after an in-flight decode step can
be enqueued before that step's tokens are read (chain): only when schedule() would give the same step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blockspec.config import EngineConfig
from blockspec.engine.outputs import FinishReason
from blockspec.engine.sequence import Sequence, SeqStatus
from blockspec.kv.block_manager import BlockManager
from blockspec.kv.state_slots import StateSlots
from blockspec.speculative.draft_len import DraftLenPolicy, FixedDraftLen
from blockspec.speculative.drafts import NO_DRAFTS


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_rows: int  # rows in this step's target forward: a prefill chunk, or 1 + k (the bonus and k drafts)
    is_prefill: bool
    next_k: int = 0  # drafts to propose from the request's new bonus (0: none, or its prefill goes on)

    @property
    def k(self) -> int:
        """Drafts verified this step: a prefix of seq.drafts (the token budget may leave fewer rows)."""
        return 0 if self.is_prefill else self.num_rows - 1


class Scheduler:
    def __init__(self, blocks: BlockManager, config: EngineConfig, max_draft_len: int, max_model_len: int,
                 state_slots: StateSlots | None = None) -> None:
        """max_draft_len: the proposer's K (0: plain decoding); the draft length policy picks K <= it (by default
        the config's schedule: LLMEngine.set_draft_len_policy replaces it). state_slots: a hybrid target's
        recurrent-state slots (None: the target keeps no state per sequence)."""
        self.blocks, self.config, self.state_slots = blocks, config, state_slots
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.min_admit = min(config.min_admit, config.max_num_seqs)  # see EngineConfig.min_admit
        self.max_draft_len, self.max_model_len = max_draft_len, max_model_len
        schedule = config.draft_len_schedule if isinstance(config.draft_len_schedule, dict) else None
        self.draft_len: DraftLenPolicy = FixedDraftLen(schedule, max_draft_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.state_slots.give_back(seq.state_slot)  # type: ignore[union-attr]
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        self._release_slot(seq)
        seq.num_computed = seq.num_hashed = 0
        seq.drafts = NO_DRAFTS
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to cover num_tokens positions, preempting newer requests if needed."""
        need = self.blocks.blocks_needed(seq.block_table, num_tokens)
        while not self.blocks.can_allocate(need):
            victim = max((s for s in self.running if s is not seq), key=lambda s: s.arrival, default=None)
            if victim is None or victim.arrival < seq.arrival:
                return False
            self._preempt(victim)
        self.blocks.grow(seq.block_table, num_tokens)
        return True

    def schedule(self) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens
        for seq in sorted(self.running, key=lambda s: s.arrival):
            # preempted while reserving for an older request (a status check, not a scan of hundreds of requests)
            if seq.status is not SeqStatus.RUNNING:
                continue
            prefill = seq.in_prefill
            if prefill:
                rows = min(seq.prefill_len - seq.num_computed, budget)
            else:  # a request left without budget verifies a prefix of its drafts
                rows = min(1 + seq.drafts.k, budget)
            if rows <= 0:
                continue
            if not self._reserve(seq, seq.num_computed + rows):
                self._preempt(seq)
                continue
            out.append(ScheduledSeq(seq, rows, prefill))
            budget -= rows
        admit = self._admits()  # once: a group being admitted is not cut short by its own first members
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.match_prefix(seq.tokens, seq.prefill_len - 1)
            seq.block_table.extend(hits)
            seq.num_computed, seq.num_hashed = len(hits) * self.blocks.block_size, len(hits)
            rows = min(seq.prefill_len - seq.num_computed, budget)
            need = self.blocks.blocks_needed(seq.block_table, seq.num_computed + rows)
            if not self.blocks.can_allocate(need):
                # a waiting request holds no blocks: give the hits back so running requests can use them
                self.blocks.release(seq.block_table)
                seq.num_computed = seq.num_hashed = 0
                break
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, seq.num_computed + rows)
            seq.status = SeqStatus.RUNNING
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.take()
            self.running.append(seq)
            out.append(ScheduledSeq(seq, rows, True))
            budget -= rows
        K = self.draft_len.next_k(len(self.running)) if self.max_draft_len and self.running else 0
        for s in out:
            if not s.is_prefill or s.seq.num_computed + s.num_rows == s.seq.prefill_len:
                s.next_k = self._next_k(s.seq, s.seq.num_computed + s.num_rows, K)
        return out

    def _admits(self) -> bool:
        """Whether a waiting request may be admitted now: a free row, and while others decode, room for a group of
        min_admit (decoding continues on the graph until a group of waiting requests fits)."""
        free = self.max_num_seqs - len(self.running)
        return bool(self.waiting) and free > 0 and not (self.running and free < min(self.min_admit, len(self.waiting)))

    def _next_k(self, seq: Sequence, end: int, K: int) -> int:
        """Drafts to propose for a request whose KV reaches at most `end` positions after this step: its next verify
        window (bonus at <= end, then the drafts) must end inside the context."""
        return max(0, min(K, self.max_model_len - 1 - end)) if seq.speculate else 0

    def chain(self, seqs: list[Sequence], K: int) -> bool:
        """Would schedule() run the step after an in-flight decode step of `seqs` (each verifying K drafts and
        proposing K) as that same step? The same requests (none finished, none waiting to be admitted, the batch
        within the token budget), the same K for the next drafts, whatever the in-flight step accepts. If so, their
        blocks are reserved for its verify window at most and True is returned; nothing is preempted (where
        schedule() might preempt, the engine waits for the in-flight step instead)."""
        if (self._admits() or len(self.running) != len(seqs) or any(s.finished for s in seqs)
                or len(seqs) * (K + 1) > self.max_num_batched_tokens):
            return False
        sched_k = self.draft_len.k(len(seqs))
        reach = [s.num_computed + 2 * (K + 1) for s in seqs]  # the in-flight window, then the chained one at most
        if any(self._next_k(s, r, sched_k) != K for s, r in zip(seqs, reach)):
            return False
        need = sum(self.blocks.blocks_needed(s.block_table, r) for s, r in zip(seqs, reach))
        if not self.blocks.can_allocate(need):
            return False
        for s, r in zip(seqs, reach):
            self.blocks.grow(s.block_table, r)
        self.draft_len.chained(K)
        return True

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq.block_table)
        self._release_slot(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.blocks.release(seq.block_table)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
        elif not seq.finished:
            self.finish(seq, FinishReason.ABORT)
