"""Continuous batching: which requests run this step, with how many new tokens each.

Every step the running decodes go first (each needs 1 + K rows, the bonus and its drafts, and KV slots for them;
the next draft block needs none, its K/V are never stored), then unfinished prefills, then waiting requests, chunked to fit the token budget. When the pool runs out of
blocks the newest running request is preempted: its blocks are released (full committed blocks stay in the prefix
cache) and it re-enters the waiting queue at the front, to be recomputed later with unchanged output."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blockspec.engine.outputs import FinishReason
from blockspec.engine.sequence import Sequence, SeqStatus
from blockspec.kv.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_rows: int  # rows in this step's target forward: a prefill chunk, or 1 + len(drafts)
    is_prefill: bool


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 min_admit: int = 1) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_admit = min(min_admit, max_num_seqs)  # see EngineConfig.min_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.num_computed = seq.num_hashed = 0
        seq.drafts, seq.draft_probs = [], None
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
            else:
                rows = min(1 + len(seq.drafts), budget)
                if 0 < rows <= len(seq.drafts):  # a request left without budget keeps its drafts for a later step
                    seq.drafts = seq.drafts[: rows - 1]
            if rows <= 0:
                continue
            if not self._reserve(seq, seq.num_computed + rows):
                self._preempt(seq)
                continue
            out.append(ScheduledSeq(seq, rows, prefill))
            budget -= rows
        if self.running and self.max_num_seqs - len(self.running) < min(self.min_admit, len(self.waiting)):
            return out  # decoding continues on the graph until a group of waiting requests fits
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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
            self.running.append(seq)
            out.append(ScheduledSeq(seq, rows, True))
            budget -= rows
        return out

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq.block_table)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.blocks.release(seq.block_table)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
        elif not seq.finished:
            self.finish(seq, FinishReason.ABORT)
