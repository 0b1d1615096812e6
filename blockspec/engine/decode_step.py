"""The decode step: B requests, each verifying a bonus + K drafts (K = 0: plain decoding), in one static-shape
function over the shared stages of blockspec/speculative/step.py: verify B x (K+1) rows -> sample -> accept ->
append the committed rows to the proposer's context -> propose the next block from each request's new bonus. No host
sync inside; the result is one packed int64 tensor [B, 2K+2] = (emitted tokens [K+1], num_accepted, next drafts
[K]) copied to the host once.

Inputs live in static per-bucket buffers (batch padded up to a bucket size), so on CUDA the whole step is captured
once per (bucket, K, sampling mode) as a CUDA graph and replayed; `enforce_eager` (and CPU) runs the same function
uncaptured, so graph and eager results are equal. Padding rows write nothing: their slots are -1.

A step is launched (enqueued, its result copied to pinned host memory behind it) and collected (wait, parse) apart:
launch_next enqueues the following step of the same requests from the device-side result of the one before (bonus,
drafts, positions), so the engine can overlap its host work with the GPU (engine/llm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, StepResult, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingParams, SamplingRows, sample_rows
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.proposer import CommittedRows, DraftBatch, StepModels
from blockspec.speculative.step import commit_slots, slot_mapping, verify


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get their own graph: powers of two, then steps of 32, capped by max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs] + list(range(64, max_num_seqs, 32))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class DecodeBuffers:
    """Static inputs of one (bucket, K) decode step."""

    input_ids: torch.Tensor  # [B, K+1] int64: bonus, d_1..d_K
    start: torch.Tensor  # [B] int64: position of the bonus (= tokens already in the KV)
    valid: torch.Tensor  # [B] bool: False for padding rows
    block_tables: torch.Tensor  # [B, W] int64
    sampling: SamplingRows  # [B] per-row sampling parameters (static: each step's rows are copied in)
    query_start: torch.Tensor  # [B+1] int32: row offsets, (K+1) apart
    draft_query_start: torch.Tensor  # [B+1] int32: row offsets of the next draft blocks, draft_rows(K) apart

    @classmethod
    def allocate(cls, B: int, K: int, draft_rows: int, width: int, device: torch.device) -> DecodeBuffers:
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        offsets = torch.arange(B + 1, dtype=torch.int32, device=device)
        return cls(z(B, K + 1), z(B), z(B, dtype=torch.bool), z(B, width), SamplingRows.allocate(B, device),
                   offsets * (K + 1), offsets * draft_rows)


@dataclass
class Launched:
    """A decode step enqueued on the device; its packed result [n, 2K+2] is on its way to `host`."""

    seqs: list[Sequence]
    K: int
    buf: DecodeBuffers
    rows: SamplingRows  # the sampling rows the step read (views of buf)
    packed: torch.Tensor  # [B, 2K+2] on the device; the graph's static output, overwritten by the next replay
    host: torch.Tensor  # [n, 2K+2] pinned copy of packed[:n]
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU, where launching ran the step)


class DecodeStep:
    def __init__(self, models: StepModels, acceptance: AcceptancePolicy, max_num_seqs: int, max_model_len: int,
                 vocab_size: int, capture: bool) -> None:
        self.models, self.acceptance, self.vocab_size = models, acceptance, vocab_size
        self.device = models.pool.k.device
        self.buckets = buckets(max_num_seqs)
        self.capture = capture
        K = models.proposer.num_draft_tokens if models.proposer is not None else 0
        self.width = -(-(max_model_len + K + 1) // models.pool.block_size)  # block-table columns: the verify window
        self.buffers: dict[tuple[int, int], DecodeBuffers] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if capture else None
        # gap timing (benchmarks): per replay, CUDA events at its start and end; host_gaps_ms() reads them
        self.record_gaps = False
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def draft_rows(self, K: int) -> int:
        """Rows of the draft block this step proposes with K drafts (K + 1 without a proposer or drafts)."""
        proposer = self.models.proposer
        return proposer.draft_rows(K) if proposer is not None and K > 0 else K + 1

    def _takes(self, s: ScheduledSeq) -> bool:
        """Whether the decode step can run this scheduled request: decoding, with argmax drafts (or none; drafts
        need a proposer)."""
        return (not s.is_prefill and s.seq.draft_probs is None
                and (self.models.proposer is not None or not s.seq.drafts))

    def eligible(self, scheduled: list[ScheduledSeq]) -> int | None:
        """K when every scheduled request decodes with K argmax drafts (or none) and the batch fits a bucket."""
        if not scheduled or len(scheduled) > self.buckets[-1]:
            return None
        K = len(scheduled[0].seq.drafts)
        return K if all(self._takes(s) and len(s.seq.drafts) == K for s in scheduled) else None

    def split(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """A mixed step's requests -> (the largest group the decode step can take: decoding with the same K argmax
        drafts, at most the largest bucket; everything else)."""
        groups: dict[int, list[ScheduledSeq]] = {}
        for s in scheduled:
            if self._takes(s):
                groups.setdefault(len(s.seq.drafts), []).append(s)
        if not groups:
            return [], list(scheduled)
        group = max(groups.values(), key=len)[: self.buckets[-1]]
        taken = {id(s) for s in group}
        return group, [s for s in scheduled if id(s) not in taken]

    def run(self, seqs: list[Sequence], K: int) -> list[StepResult]:
        return self.collect(self.launch(seqs, K))

    def launch(self, seqs: list[Sequence], K: int) -> Launched:
        B = next(b for b in self.buckets if b >= len(seqs))
        buf = self.buffers.get((B, K))
        if buf is None:
            buf = self.buffers[(B, K)] = DecodeBuffers.allocate(B, K, self.draft_rows(K), self.width, self.device)
        rows = self.fill(buf, seqs, K)
        return self._launch(seqs, K, buf, rows)

    def launch_next(self, prev: Launched) -> Launched:
        """The next step of prev's requests, its inputs derived on the device from prev's result: the bonus (last
        emitted token) and drafts it produced, positions advanced by num_accepted + 1; block tables re-read from
        the host (the engine grew them for this step before calling). No wait on prev."""
        buf, K = prev.buf, prev.K
        n = prev.packed[:, K + 1]
        bonus = prev.packed[:, : K + 1].gather(1, n[:, None])
        buf.input_ids.copy_(torch.cat([bonus, prev.packed[:, K + 2:]], dim=1))
        buf.start.add_(torch.where(buf.valid, n + 1, 0))  # padding rows stay at position 0
        buf.block_tables.copy_(self._tables(prev.seqs, buf.input_ids.shape[0]), non_blocking=True)
        return self._launch(prev.seqs, K, buf, prev.rows)

    def _launch(self, seqs: list[Sequence], K: int, buf: DecodeBuffers, rows: SamplingRows) -> Launched:
        packed = self.replay(buf, rows, K) if self.capture else self.forward(buf, rows)
        if packed.device.type != "cuda":
            return Launched(seqs, K, buf, rows, packed, packed[: len(seqs)], None)
        host = torch.empty(packed[: len(seqs)].shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed[: len(seqs)], non_blocking=True)  # the step's one device-to-host copy
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, also when packed is not on cuda:0
        return Launched(seqs, K, buf, rows, packed, host, done)

    def collect(self, launched: Launched) -> list[StepResult]:
        """Wait for a launched step and read its result per request."""
        if launched.done is not None:
            launched.done.synchronize()
        K, out = launched.K, []
        for seq, r in zip(launched.seqs, launched.host.tolist()):
            n = r[K + 1]
            out.append(StepResult(seq, r[: n + 1], n, n + 1, r[K + 2:] if K > 0 else None))
        return out

    def host_gaps_ms(self) -> list[float]:
        """Idle time of the GPU between consecutive recorded replays (waits for the last one)."""
        if not self.marks:
            return []
        self.marks[-1][1].synchronize()
        return [end.elapsed_time(start) for (_, end), (start, _) in zip(self.marks, self.marks[1:])]

    def _tables(self, seqs: list[Sequence], B: int) -> torch.Tensor:
        """[B, width] block tables on the host, padding rows all block 0."""
        tables = torch.zeros(B, self.width, dtype=torch.long)
        tables[: len(seqs)] = block_tables(seqs, self.width, torch.device("cpu"))
        return tables

    def fill(self, buf: DecodeBuffers, seqs: list[Sequence], K: int) -> SamplingRows:
        """Copy this step's inputs into the static buffers (host -> device, one copy per buffer)."""
        B, n, cpu = buf.input_ids.shape[0], len(seqs), torch.device("cpu")
        pad = B - n  # padding rows: greedy, position 0, block table all block 0, slots -1 (never written)
        tables = self._tables(seqs, B)
        rows = SamplingRows.build([s.params for s in seqs] + [SamplingParams()] * pad, [s.seed for s in seqs] + [0] * pad,
                                  cpu, self.vocab_size)
        host = {
            "input_ids": host_tensor([t for s in seqs for t in (s.bonus, *s.drafts)] + [0] * (pad * (K + 1))
                                     ).view(B, K + 1),
            "start": host_tensor([s.num_computed for s in seqs] + [0] * pad),
            "valid": host_tensor([True] * n + [False] * pad, torch.bool), "block_tables": tables,
        }
        for name, value in host.items():
            getattr(buf, name).copy_(value, non_blocking=True)
        return rows.copy_to(buf.sampling)

    def replay(self, buf: DecodeBuffers, rows: SamplingRows, K: int) -> torch.Tensor:
        """The step from its CUDA graph, captured on the first call for this (bucket, K, sampling mode)."""
        key = (buf.input_ids.shape[0], K, *rows.mode)
        if key not in self.graphs:
            # Warm up on a side stream (Triton compiles its kernels here), then capture. The warm-up runs the real
            # step on the real inputs; its KV writes are exactly the ones the replay makes.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(buf, rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                packed = self.forward(buf, rows)
            self.graphs[key] = (graph, packed)
        graph, packed = self.graphs[key]
        if self.record_gaps:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.marks.append((start, end))
        else:
            graph.replay()
        return packed

    def forward(self, buf: DecodeBuffers, rows: SamplingRows) -> torch.Tensor:
        """The step itself, eagerly: what the graph captures."""
        models, proposer = self.models, self.models.proposer
        B, K1 = buf.input_ids.shape
        K = K1 - 1
        pos = buf.start[:, None] + torch.arange(K1, device=buf.start.device)  # [B, K+1]
        slots = torch.where(buf.valid[:, None], slot_mapping(buf.block_tables, pos, models.pool.block_size), -1)
        batch = PagedBatch(pos.flatten(), slots.flatten(), buf.query_start, (buf.start + K1).int(), buf.block_tables,
                           K1, None)
        out = verify(models, buf.input_ids.flatten(), batch)
        chosen = sample_rows(out.logits, rows.repeat(K1), batch.positions + 1).view(B, K1)
        if K > 0:
            tokens, n = self.acceptance.accept(buf.input_ids[:, 1:], chosen, rows.seeds, buf.start)
        else:
            tokens, n = chosen, torch.zeros(B, dtype=torch.long, device=chosen.device)
        packed = torch.cat([tokens, n[:, None]], dim=1)
        if proposer is None:
            return packed
        proposer.append_context(models, CommittedRows(buf.input_ids.flatten(), batch, commit_slots(slots, n).flatten(),
                                                      out.taps))
        if K == 0:
            return packed
        # the next block from each request's new bonus (the last emitted token) at position start + n + 1
        bonus = tokens.gather(1, n[:, None])[:, 0]
        proposal = proposer.propose(models, DraftBatch(bonus, buf.start + n + 1, buf.block_tables,
                                                       buf.draft_query_start, K, self.draft_rows(K)))
        return torch.cat([packed, proposal.drafts], dim=1)
