"""The decode step: B requests, each verifying a bonus + K drafts (K = 0: plain decoding), in one static-shape
function: target forward over B x (K+1) rows -> sampling -> acceptance -> draft-context append of the committed
rows -> the next block's drafts (draft forward from each request's new bonus). No host sync inside; the result is
one packed int64 tensor [B, 2K+2] = (emitted tokens [K+1], num_accepted, next drafts [K]) copied to the host once.

Inputs live in static per-bucket buffers (batch padded up to a bucket size), so on CUDA the whole step is captured
once per (bucket, K, sampling mode) as a CUDA graph and replayed; `enforce_eager` (and CPU) runs the same function
uncaptured, so graph and eager results are equal. Padding rows write nothing: their slots are -1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec import rng
from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.sequence import Sequence, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingParams, SamplingRows, sample_rows
from blockspec.speculative.verify import accept_tokens

if TYPE_CHECKING:
    from blockspec.engine.model_runner import ModelRunner, StepResult


def forced_accept(seeds: torch.Tensor, start: torch.Tensor, K: int, tau: float) -> torch.Tensor:
    """Benchmark only (EngineConfig.bench_forced_tau): drafts accepted per verify block, mean tau - 1, pseudo-random
    by request seed and block start, so the decode step and the varlen step force the same n."""
    want = min(max(tau - 1.0, 0.0), float(K))
    u = rng.uniform(seeds, start, rng.STREAM_BENCH, 1)[:, 0]
    return (int(want) + (u < want - int(want)).long()).clamp_max(K)


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
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    query_start: torch.Tensor  # [B+1] int32: row offsets, (K+1) apart
    draft_query_start: torch.Tensor  # [B+1] int32: row offsets of the next draft blocks, draft_rows(K) apart

    @classmethod
    def allocate(cls, B: int, K: int, draft_rows: int, width: int, device: torch.device) -> "DecodeBuffers":
        z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        offsets = torch.arange(B + 1, dtype=torch.int32, device=device)
        return cls(z(B, K + 1), z(B), z(B, dtype=torch.bool), z(B, width), z(B, dtype=torch.float32), z(B),
                   torch.ones(B, dtype=torch.float32, device=device), z(B), offsets * (K + 1), offsets * draft_rows)


class DecodeStep:
    def __init__(self, runner: "ModelRunner", max_num_seqs: int, capture: bool) -> None:
        self.runner = runner
        self.buckets = buckets(max_num_seqs)
        self.capture = capture
        page = runner.pool.block_size
        K = runner.draft.spec.num_draft_tokens if runner.draft is not None else 0
        self.width = -(-(runner.max_model_len + K + 1) // page)  # block-table columns: up to the verify window
        self.buffers: dict[tuple[int, int], DecodeBuffers] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if capture else None
        self.forced_tau: float | None = None  # benchmark only (EngineConfig.bench_forced_tau)

    def draft_rows(self, K: int) -> int:
        """Rows of the draft block this step proposes with K drafts (K + 1 without a drafter or drafts)."""
        draft = self.runner.draft
        return draft.spec.draft_rows(K) if draft is not None and K > 0 else K + 1

    def _takes(self, s) -> bool:
        """Whether the decode step can run this scheduled request: decoding, with argmax drafts (or none; drafts
        need a drafter)."""
        return not s.is_prefill and s.seq.draft_probs is None and (self.runner.draft is not None or not s.seq.drafts)

    def eligible(self, scheduled: list) -> int | None:
        """K when every scheduled request decodes with K argmax drafts (or none) and the batch fits a bucket."""
        if not scheduled or len(scheduled) > self.buckets[-1]:
            return None
        K = len(scheduled[0].seq.drafts)
        return K if all(self._takes(s) and len(s.seq.drafts) == K for s in scheduled) else None

    def split(self, scheduled: list) -> tuple[list, list]:
        """A mixed step's requests -> (the largest group the decode step can take: decoding with the same K argmax
        drafts, at most the largest bucket; everything else)."""
        groups: dict[int, list] = {}
        for s in scheduled:
            if self._takes(s):
                groups.setdefault(len(s.seq.drafts), []).append(s)
        if not groups:
            return [], list(scheduled)
        group = max(groups.values(), key=len)[: self.buckets[-1]]
        taken = {id(s) for s in group}
        return group, [s for s in scheduled if id(s) not in taken]

    def run(self, seqs: list[Sequence], K: int) -> list["StepResult"]:
        from blockspec.engine.model_runner import StepResult

        B = next(b for b in self.buckets if b >= len(seqs))
        buf = self.buffers.get((B, K))
        if buf is None:
            buf = self.buffers[(B, K)] = DecodeBuffers.allocate(B, K, self.draft_rows(K), self.width,
                                                                self.runner.device)
        rows = self._fill(buf, seqs, K)
        if self.capture:
            packed = self._replay(buf, rows, K)
        else:
            packed = self.forward(buf, rows)
        host = packed[: len(seqs)].tolist()  # the step's one device-to-host copy
        out = []
        for seq, r in zip(seqs, host):
            n = r[K + 1]
            out.append(StepResult(seq, r[: n + 1], n, n + 1, r[K + 2:] if K > 0 else None))
        return out

    def _fill(self, buf: DecodeBuffers, seqs: list[Sequence], K: int) -> SamplingRows:
        """Copy this step's inputs into the static buffers (host -> device, one copy per buffer)."""
        B, n, cpu = buf.input_ids.shape[0], len(seqs), torch.device("cpu")
        pad = B - n  # padding rows: greedy, position 0, block table all block 0, slots -1 (never written)
        tables = torch.zeros(B, self.width, dtype=torch.long)
        tables[:n] = block_tables(seqs, self.width, cpu)
        rows = SamplingRows.build([s.params for s in seqs] + [SamplingParams()] * pad, [s.seed for s in seqs] + [0] * pad,
                                  cpu, self.runner.vocab_size)
        host = {
            "input_ids": host_tensor([t for s in seqs for t in (s.bonus, *s.drafts)] + [0] * (pad * (K + 1))
                                     ).view(B, K + 1),
            "start": host_tensor([s.num_computed for s in seqs] + [0] * pad),
            "valid": host_tensor([True] * n + [False] * pad, torch.bool), "block_tables": tables,
            "temperature": rows.temperature, "top_k": rows.top_k, "top_p": rows.top_p, "seeds": rows.seeds,
        }
        for name, value in host.items():
            getattr(buf, name).copy_(value, non_blocking=True)
        return SamplingRows(buf.temperature, buf.top_k, buf.top_p, buf.seeds, rows.all_greedy, rows.use_top_k,
                            rows.use_top_p)

    def _replay(self, buf: DecodeBuffers, rows: SamplingRows, K: int) -> torch.Tensor:
        key = (buf.input_ids.shape[0], K, rows.all_greedy, rows.use_top_k, rows.use_top_p)
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
        graph.replay()
        return packed

    def forward(self, buf: DecodeBuffers, rows: SamplingRows) -> torch.Tensor:
        r = self.runner
        lm, draft, pool = r.lm.model, r.draft, r.pool
        B, K1 = buf.input_ids.shape
        K, page = K1 - 1, pool.block_size
        R = self.draft_rows(K)
        offs = torch.arange(max(K1, R), device=buf.start.device)
        pos = buf.start[:, None] + offs[:K1]  # [B, K+1]
        slots = buf.block_tables.gather(1, pos // page) * page + pos % page
        slots = torch.where(buf.valid[:, None], slots, -1)
        batch = PagedBatch(pos.flatten(), slots.flatten(), buf.query_start, (buf.start + K1).int(), buf.block_tables,
                           K1, None)
        out = lm(buf.input_ids.flatten(), batch.positions, r.backend.target(pool, batch), tap_layers=r.taps)
        chosen = sample_rows(out.logits, rows.repeat(K1), batch.positions + 1).view(B, K1)
        if K > 0:
            tokens, n = accept_tokens(buf.input_ids[:, 1:], chosen)
            if self.forced_tau is not None:
                tokens, n = chosen, forced_accept(buf.seeds, buf.start, K, self.forced_tau)
        else:
            tokens, n = chosen, torch.zeros(B, dtype=torch.long, device=chosen.device)
        if draft is None:
            return torch.cat([tokens, n[:, None]], dim=1)
        ctx_slots = torch.where(offs[None, :K1] <= n[:, None], slots, -1).flatten()
        r._append_context(out.taps, batch.positions, ctx_slots)
        if K == 0:
            return torch.cat([tokens, n[:, None]], dim=1)
        # the next block: [new bonus, MASK x] at positions start + n + 1 ..., over the context committed so far;
        # R = K + 1 rows, or the trained block size with full_block_drafting (its first K drafts are used)
        bonus = tokens.gather(1, n[:, None])
        start = buf.start + n + 1
        ids = torch.cat([bonus, torch.full((B, R - 1), draft.spec.mask_token_id, device=bonus.device)], dim=1)
        dpos = (start[:, None] + offs[:R]).flatten()
        dbatch = PagedBatch(dpos, torch.full_like(dpos, -1), buf.draft_query_start, start.int(), buf.block_tables, R,
                            None)
        hidden = draft.model(lm.embed_tokens(ids.flatten()), dpos, r.backend.draft(pool, dbatch))
        hidden = hidden.view(B, R, -1)[:, 1:K1].reshape(B * K, -1)
        drafts = draft.model.greedy_drafts(hidden, lm.lm_head).view(B, K)
        return torch.cat([tokens, n[:, None], drafts], dim=1)
