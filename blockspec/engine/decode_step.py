"""The decode step: B requests, each verifying a bonus + K drafts (K = 0: plain decoding) and proposing the next
K' drafts, in one static-shape function over the shared stages of blockspec/speculative/step.py: verify B x (K+1)
rows -> sample -> accept -> append the committed rows to the proposer's context -> propose the next block from each
request's new bonus (sampled from the drafter's distribution under probabilistic drafting). No host sync inside; the
result is one packed int64 tensor [B, K+2+K'] = (emitted tokens [K+1], num_accepted, next drafts [K']) copied to the
host once, and with sampled drafts their distributions q [B, K', V], which stay on the device.

Inputs live in static per-bucket buffers (batch padded up to a bucket size), so on CUDA the whole step is captured
once per (bucket, K, K', sampling mode) as a CUDA graph and replayed; `enforce_eager` (and CPU) runs the same
function uncaptured, so graph and eager results are equal. Padding rows write nothing: their slots are -1 (a hybrid
target's padding rows read and write its sink state slot, which no request owns). A hybrid target's verify blocks
keep their rows' inputs and their state is committed after accept, inside the same function (commit_state).

A step is launched (enqueued, its result copied to pinned host memory behind it) and collected (wait, parse) apart:
launch_next enqueues the following step of the same requests from the device-side result of the one before (bonus,
drafts, positions), so the engine can overlap its host work with the GPU (engine/llm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.observer import StepObserver
from blockspec.engine.recurrent import sink_slot
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, StepResult, block_tables
from blockspec.engine.step_layout import StepLayout
from blockspec.host_tensors import host_tensor
from blockspec.models.hybrid_state import RecurrentBatch
from blockspec.sampling import SamplingRows, sample_rows
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.drafts import verify_q
from blockspec.speculative.proposer import CommittedRows, StepModels
from blockspec.speculative.step import accept, commit_slots, commit_state, propose, slot_mapping, verify


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get their own graph: powers of two, then steps of 32, capped by max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs] + list(range(64, max_num_seqs, 32))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class DecodeBuffers:
    """Static inputs of one (bucket, K, K') decode step."""

    input_ids: torch.Tensor  # [B, K+1] int64: bonus, d_1..d_K
    start: torch.Tensor  # [B] int64: position of the bonus (= tokens already in the KV)
    valid: torch.Tensor  # [B] bool: False for padding rows
    block_tables: torch.Tensor  # [B, W] int64
    sampling: SamplingRows  # [B] per-row sampling parameters (static: each step's rows are copied in)
    query_start: torch.Tensor  # [B+1] int32: row offsets, (K+1) apart
    q: torch.Tensor | None  # [B, K, V] fp32 the drafts' distributions (probabilistic drafting; None: argmax drafts)
    state_slots: torch.Tensor  # [B] int64 a hybrid target's recurrent-state slot per request (padding: the sink)

    @classmethod
    def allocate(cls, B: int, K: int, width: int, vocab: int | None, device: torch.device) -> DecodeBuffers:
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        q = z(B, K, vocab, dtype=torch.float32) if vocab is not None and K > 0 else None
        return cls(z(B, K + 1), z(B), z(B, dtype=torch.bool), z(B, width), SamplingRows.allocate(B, device),
                   torch.arange(B + 1, dtype=torch.int32, device=device) * (K + 1), q, z(B))


@dataclass
class Launched:
    """A decode step enqueued on the device; its packed result [n, K+2+K'] is on its way to `host`."""

    layout: StepLayout  # its n requests (a chained step's are those of the step before)
    K: int  # drafts verified
    next_k: int  # drafts proposed (K')
    buf: DecodeBuffers
    rows: SamplingRows  # the sampling rows the step read (views of buf)
    packed: torch.Tensor  # [B, K+2+K'] on the device; the graph's static output, overwritten by the next replay
    host: torch.Tensor  # [n, K+2+K'] pinned copy of packed[:n]
    q: torch.Tensor | None  # [n, K', V] the next drafts' distributions, copied out of the graph's output
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU, where launching ran the step)

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.layout.scheduled]


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
        self.observer: StepObserver = StepObserver()  # the engine's (benchmarks time the replays through it)

    @property
    def sampled_drafts(self) -> bool:
        return self.models.proposer is not None and self.models.proposer.probabilistic

    @staticmethod
    def shape(s: ScheduledSeq) -> tuple[int, int] | None:
        """(K, K') of a request the decode step can run (decoding), None for a prefill chunk."""
        return None if s.is_prefill else (s.k, s.next_k)

    def eligible(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether every scheduled request decodes with the same (K, K') and the batch fits a bucket."""
        shape = self.shape(scheduled[0]) if scheduled else None
        return (shape is not None and len(scheduled) <= self.buckets[-1]
                and all(self.shape(s) == shape for s in scheduled))

    def split(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        """A mixed step's requests -> (the largest group the decode step can take: decoding with the same (K, K'),
        at most the largest bucket; everything else)."""
        groups: dict[tuple[int, int], list[ScheduledSeq]] = {}
        for s in scheduled:
            if (shape := self.shape(s)) is not None:
                groups.setdefault(shape, []).append(s)
        if not groups:
            return [], list(scheduled)
        group = max(groups.values(), key=len)[: self.buckets[-1]]
        taken = {id(s) for s in group}
        return group, [s for s in scheduled if id(s) not in taken]

    def launch(self, scheduled: list[ScheduledSeq]) -> Launched:
        layout, K, next_k = StepLayout.for_decode(scheduled), scheduled[0].k, scheduled[0].next_k
        buf = self._buffers(len(scheduled), K, next_k)
        with self.observer.stage("fill"):
            rows = self.fill(buf, layout, K)
        return self._launch(layout, K, next_k, buf, rows)

    def _buffers(self, n: int, K: int, next_k: int) -> DecodeBuffers:
        B = next(b for b in self.buckets if b >= n)
        buf = self.buffers.get((B, K, next_k))
        if buf is None:
            vocab = self.vocab_size if self.sampled_drafts else None
            buf = self.buffers[(B, K, next_k)] = DecodeBuffers.allocate(B, K, self.width, vocab, self.device)
        return buf

    def launch_next(self, prev: Launched) -> Launched:
        """The next step of prev's requests (prev.K == prev.next_k), its inputs derived on the device from prev's
        result: the bonus (last emitted token) and drafts it produced (and their q), positions advanced by
        num_accepted + 1; block tables re-read from the host (the scheduler grew them for this step). No wait on
        prev."""
        buf, K = prev.buf, prev.K
        n = prev.packed[:, K + 1]
        bonus = prev.packed[:, : K + 1].gather(1, n[:, None])
        buf.input_ids.copy_(torch.cat([bonus, prev.packed[:, K + 2:]], dim=1))
        if prev.q is not None:
            buf.q[: len(prev.layout.scheduled)].copy_(prev.q)
        buf.start.add_(torch.where(buf.valid, n + 1, 0))  # padding rows stay at position 0
        buf.block_tables.copy_(self._tables(prev.seqs, buf.input_ids.shape[0]), non_blocking=True)
        return self._launch(prev.layout, K, K, buf, prev.rows)

    def _launch(self, layout: StepLayout, K: int, next_k: int, buf: DecodeBuffers,
                rows: SamplingRows) -> Launched:
        packed, q = self.observer.replay(
            lambda: self.replay(buf, rows, K, next_k) if self.capture else self.forward(buf, rows, next_k))
        n = len(layout.scheduled)
        # q out of the graph's static output before anything else is enqueued (a chained replay overwrites it)
        q = q[:n].clone() if q is not None else None
        if packed.device.type != "cuda":
            return Launched(layout, K, next_k, buf, rows, packed, packed[:n], q, None)
        host = torch.empty(packed[:n].shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed[:n], non_blocking=True)  # the step's one device-to-host copy
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(packed.device))  # the copy's stream, also when packed is not on cuda:0
        return Launched(layout, K, next_k, buf, rows, packed, host, q, done)

    def collect(self, launched: Launched) -> list[StepResult]:
        """Wait for a launched step and read its result per request."""
        if launched.done is not None:
            launched.done.synchronize()
        return launched.layout.results(launched.host.flatten().tolist(), launched.q)

    def _tables(self, seqs: list[Sequence], B: int) -> torch.Tensor:
        """[B, width] block tables on the host, padding rows all block 0."""
        tables = torch.zeros(B, self.width, dtype=torch.long)
        tables[: len(seqs)] = block_tables(seqs, self.width, torch.device("cpu"))
        return tables

    def fill(self, buf: DecodeBuffers, layout: StepLayout, K: int) -> SamplingRows:
        """Copy this step's inputs into the static buffers (host -> device, one copy per buffer)."""
        B, seqs = buf.input_ids.shape[0], [s.seq for s in layout.scheduled]
        n = len(seqs)
        pad = B - n  # padding rows: greedy, position 0, block table all block 0, slots -1 (never written)
        rows = layout.sampling_rows(torch.device("cpu"), self.vocab_size, pad)
        host = {
            "input_ids": host_tensor(layout.input_ids + [0] * (pad * (K + 1))).view(B, K + 1),
            "start": host_tensor(layout.start + [0] * pad),
            "valid": host_tensor([True] * n + [False] * pad, torch.bool), "block_tables": self._tables(seqs, B),
        }
        if self.models.state is not None:
            host["state_slots"] = host_tensor([s.state_slot for s in seqs] + [sink_slot(self.models.state)] * pad)
        for name, value in host.items():
            getattr(buf, name).copy_(value, non_blocking=True)
        if buf.q is not None and not rows.all_greedy:  # device to device: the q each sampled row's drafts came from
            q = verify_q([s.drafts for s in seqs], K)
            buf.q[:n].copy_(q) if q is not None else buf.q[:n].zero_()
        return rows.copy_to(buf.sampling)

    def replay(self, buf: DecodeBuffers, rows: SamplingRows, K: int,
               next_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step from its CUDA graph, captured on the first call for this (bucket, K, K', sampling mode)."""
        key = (buf.input_ids.shape[0], K, next_k, *rows.mode)
        if key not in self.graphs:
            # Warm up on a side stream (Triton compiles its kernels here), then capture. The warm-up runs the real
            # step on the real inputs; its KV writes are exactly the ones the replay makes. A hybrid target's state
            # is not: a step reads the slots it writes, so the batch's slots are put back before the replay runs.
            state = self.models.state
            saved = state.save(buf.state_slots) if state is not None else None
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(buf, rows, next_k)
            torch.cuda.current_stream().wait_stream(stream)
            if saved is not None:
                state.restore(buf.state_slots, saved)  # type: ignore[union-attr]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                outputs = self.forward(buf, rows, next_k)
            self.graphs[key] = (graph, outputs)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def forward(self, buf: DecodeBuffers, rows: SamplingRows, next_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step itself, eagerly: what the graph captures. -> (packed [B, K+2+K'], q [B, K', V] or None)."""
        models, proposer = self.models, self.models.proposer
        B, K1 = buf.input_ids.shape
        pos = buf.start[:, None] + torch.arange(K1, device=buf.start.device)  # [B, K+1]
        slots = torch.where(buf.valid[:, None], slot_mapping(buf.block_tables, pos, models.pool.block_size), -1)
        batch = PagedBatch(pos.flatten(), slots.flatten(), buf.query_start, (buf.start + K1).int(), buf.block_tables,
                           K1, None)
        # a hybrid target: B sequences of K+1 rows, verify blocks when K > 0 (padding rows start fresh in the sink)
        recurrent = None if models.state is None else RecurrentBatch.uniform(models.state, buf.state_slots, K1,
                                                                              buf.start, keep=K1 > 1)
        out = verify(models, buf.input_ids.flatten(), batch, recurrent=recurrent)
        chosen = sample_rows(out.logits, rows.repeat(K1), batch.positions + 1).view(B, K1)
        sampled = buf.q is not None and not rows.all_greedy
        acc = accept(self.acceptance, buf.input_ids[:, 1:], chosen, rows, buf.start, buf.q if sampled else None,
                     out.logits.view(B, K1, -1) if sampled else None)
        commit_state(models, recurrent, acc.num_accepted)
        packed = torch.cat([acc.tokens, acc.num_accepted[:, None]], dim=1)
        if proposer is None:
            return packed, None
        proposer.append_context(models, CommittedRows(buf.input_ids.flatten(), batch,
                                                      commit_slots(slots, acc.num_accepted).flatten(), out.taps,
                                                      propose_next=next_k > 0))
        if next_k == 0:
            return packed, None
        drafts, q = propose(models, acc.bonus, acc.start, buf.block_tables, next_k, rows)
        return torch.cat([packed, drafts], dim=1), q
