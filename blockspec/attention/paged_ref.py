"""Reference attention over the paged pool (plain torch, CPU and GPU): the oracle for the Triton kernels.

A batch is a flat [T] run of new tokens, sequence after sequence (varlen). Each sequence sees the keys at positions
< kv_len through its block table, then masks by position (causal for the target, windowed in a target's sliding-window
layers: a query at p sees the keys in (p - window, p]; causal / non-causal / windowed per draft layer). A target layer
may also have learned attention sinks (gpt-oss: a per-head logit in the softmax's denominator) and may read another
layer's cache without storing (KV shared between layers: k = v = None). Loops over sequences on the host: clarity
over speed."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.attention.torch_ref import attend, build_mask, sdpa
from blockspec.kv.pool import KVPool
from blockspec.models.base import AttentionBase

ROWWISE_MAX_ROWS = 16  # a verify step's rows (K + 1 <= block size); a longer query run is a prefill chunk


@dataclass
class PagedBatch:
    """Attention metadata of one forward, all on device so a CUDA graph can capture it. max_q_len / max_kv_len are
    host-side bounds that size kernel grids (max_kv_len None: bounded by the block table, for captured steps)."""

    positions: torch.Tensor  # [T] position of each new token
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written (-1: skip)
    query_start: torch.Tensor  # [B+1] int32 row offsets of each sequence in the flat batch
    kv_lens: torch.Tensor  # [B] int32 keys at positions < kv_len are visible (before masking)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    max_q_len: int
    max_kv_len: int | None = None

    def host_lists(self) -> tuple[list[int], list[int]]:
        """(query_start, kv_lens) on the host, for the reference backend (a device sync: not for captured steps)."""
        return self.query_start.tolist(), self.kv_lens.tolist()

    def context_slots(self, i: int, length: int, block_size: int) -> torch.Tensor:
        """Slots of positions 0..length-1 of sequence i."""
        pos = torch.arange(length, device=self.block_tables.device)
        return self.block_tables[i, pos // block_size] * block_size + pos % block_size


def context_rows(batch: PagedBatch, kv_lens: list[int], block_size: int) -> list[slice | torch.Tensor]:
    """Per sequence, where its first kv_len slots lie: a slice where its blocks are consecutive pool blocks (the
    free list hands out blocks in order, so a lone stream's usually are), else the slots. A slice reads the cache in
    place: a gathered copy is written by one core and read by the other in the next op, which on the 2-core CPU
    here costs more than the attention itself (a decode row over 150 keys: 29 us in place, 160 us gathered)."""
    tables = batch.block_tables.tolist()
    rows: list[slice | torch.Tensor] = []
    for i, n in enumerate(kv_lens):
        blocks = tables[i][:-(-n // block_size)]
        if not blocks or blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            first = blocks[0] * block_size if blocks else 0
            rows.append(slice(first, first + n))
        else:
            rows.append(batch.context_slots(i, n, block_size))
    return rows


def gather(cache: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """cache [slots, Hkv, D] -> the context [n, Hkv, D]: a view for a slice, a copy for slots."""
    return cache[rows] if isinstance(rows, slice) else cache.index_select(0, rows)


def written_rows(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the slots written, the rows they come from; None: every row) of a slot mapping where -1 means "skip"."""
    keep = slots >= 0
    if bool(keep.all()):
        return slots, None
    rows = keep.nonzero()[:, 0]
    return slots[rows], rows


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          written: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """cache_* [slots, Hkv, D]; k, v [T, Hkv, D]; rows with slot -1 are skipped (written: written_rows(slots), when
    the caller stores every layer with one mapping)."""
    dest, rows = written if written is not None else written_rows(slots)
    if rows is not None:
        k, v = k[rows], v[rows]
    # index_copy_ / index_select rather than advanced indexing: 3-6x faster on CPU at decode sizes
    cache_k.index_copy_(0, dest, k if k.dtype == cache_k.dtype else k.to(cache_k.dtype))
    cache_v.index_copy_(0, dest, v if v.dtype == cache_v.dtype else v.to(cache_v.dtype))


class PagedRows:
    """A pool and a batch, with the host-side row bounds and context rows of each sequence built on first use, once
    per forward: a model whose native stack runs the attention itself (`native_paged`, blockspec/native/) never
    needs them (and never syncs for them)."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch

    @functools.cached_property
    def _host(self) -> tuple[list[int], list[int]]:
        return self.batch.host_lists()

    @property
    def qs(self) -> list[int]:
        return self._host[0]

    @functools.cached_property
    def contexts(self) -> list[slice | torch.Tensor]:
        return context_rows(self.batch, self._host[1], self.pool.block_size)


class PagedTargetAttention(PagedRows, AttentionBase):
    """Causal attention of the batch's new tokens over each sequence's paged context (AttentionFn). Per call, as the
    layer asks: `window` W (a sliding-window layer: keys in (p - W, p] only), `sinks` [Hq] (learned attention sinks),
    k = v = None (read this cache without storing: a layer that shares an earlier layer's K/V)."""

    @functools.cached_property
    def written(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return written_rows(self.batch.slot_mapping)  # the same for every layer

    @functools.cached_property
    def _masks(self) -> dict[int | None, list[torch.Tensor]]:
        return {}

    def window_masks(self, window: int | None) -> list[torch.Tensor]:
        """Per sequence, the mask of its rows over its keys 0..kv_len-1: causal, within `window` when given; built
        once per forward and window (the layers of one kind share it)."""
        if window not in self._masks:
            pos = self.batch.positions
            self._masks[window] = [
                build_mask(pos[self.qs[i]:self.qs[i + 1]], torch.arange(n, device=pos.device), True, window)
                for i, n in enumerate(self._host[1])]
        return self._masks[window]

    @property
    def masks(self) -> list[torch.Tensor]:
        return self.window_masks(None)

    def context(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new k/v rows (None: nothing to store); its (k, v) caches."""
        ck, cv = self.pool.k[layer], self.pool.v[layer]
        if k is not None and v is not None:
            store(ck, cv, k, v, self.batch.slot_mapping, self.written)
        return ck, cv

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        ck, cv = self.context(layer, k, v)
        out = torch.empty_like(q)
        for i in range(len(self.contexts)):
            a, b = self.qs[i], self.qs[i + 1]
            out[a:b] = self.attend_sequence(i, q[a:b], ck, cv, scale, window, sinks)
        return out

    def attend_sequence(self, i: int, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, scale: float,
                        window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence i's rows q [n, Hq, D] over its context in the layer caches ck / cv -> [n, Hq, D]."""
        return attend(q, gather(ck, self.contexts[i]), gather(cv, self.contexts[i]), self.window_masks(window)[i],
                      scale, sinks)


class RowwiseTargetAttention(PagedTargetAttention):
    """PagedTargetAttention computing each row of a short query run (decode, verify: at most ROWWISE_MAX_ROWS rows)
    exactly as a one-row decode step at its position does: one SDPA call over the keys up to it, no mask. CPU SDPA
    and GEMMs round a row differently with the number of rows beside it (by about an fp32 ulp); where the next
    linear rounds activations to bf16 (the quantized CPU kernels, layers/cpu_quant.py) such a difference can flip a
    near-tie, and greedy speculative output would stop equalling plain decoding. Longer runs (prefill) are computed
    alike by plain and speculative engines and keep the one masked call."""

    @functools.cached_property
    def positions(self) -> list[int]:
        return self.batch.positions.tolist()

    @property
    def native_paged(self) -> tuple[KVPool, PagedBatch] | None:
        """What a native layer stack (loading/native_stack.py over native/decoder.c) needs to run this attention
        itself: an fp32 pool on the CPU; it computes each row alone as this class does."""
        cpu_f32 = self.pool.k.device.type == "cpu" and self.pool.k.dtype == torch.float32
        return (self.pool, self.batch) if cpu_f32 else None

    def attend_sequence(self, i: int, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, scale: float,
                        window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] > ROWWISE_MAX_ROWS:
            return super().attend_sequence(i, q, ck, cv, scale, window, sinks)
        # head-major views made once per sequence, sliced per row: [1, H, rows or keys, D], as attend lays out
        keys = gather(ck, self.contexts[i]).transpose(0, 1)[None]
        values = gather(cv, self.contexts[i]).transpose(0, 1)[None]
        rows, first = q.transpose(0, 1)[None], self.qs[i]
        out = torch.empty_like(q)
        for r in range(q.shape[0]):
            n = self.positions[first + r] + 1
            lo = 0 if window is None else max(0, n - window)  # a sliding-window layer: keys (p - window, p]
            if sinks is None:
                out[r] = F.scaled_dot_product_attention(rows[:, :, r:r + 1], keys[:, :, lo:n], values[:, :, lo:n],
                                                        scale=scale, enable_gqa=q.shape[1] != ck.shape[1])[0, :, 0]
            else:
                out[r] = sdpa(rows[:, :, r:r + 1], keys[:, :, lo:n], values[:, :, lo:n], None, scale, sinks)[0, :, 0]
        return out


class PagedDraftAttention(PagedRows):
    """Draft block attention: each sequence's block rows over its cached draft context (positions < kv_len, which
    is the block's start) plus the block's own K/V, masked per layer (DraftAttentionFn)."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        super().__init__(pool, batch)
        self._masks: dict[tuple[bool, int | None], list[torch.Tensor]] = {}

    @functools.cached_property
    def k_pos(self) -> list[torch.Tensor]:
        out = []
        for i, n in enumerate(self._host[1]):
            q_pos = self.batch.positions[self.qs[i]:self.qs[i + 1]]
            out.append(torch.cat([torch.arange(n, device=q_pos.device), q_pos]))
        return out

    @property
    def native_paged(self) -> tuple[KVPool, PagedBatch] | None:
        """What a native drafter needs to run this attention itself: an fp32 draft pool on the CPU."""
        k = self.pool.draft_k
        return (self.pool, self.batch) if k.device.type == "cpu" and k.dtype == torch.float32 else None

    def _mask(self, causal: bool, window: int | None) -> list[torch.Tensor]:
        key = (causal, window)
        if key not in self._masks:
            qs = self.qs
            self._masks[key] = [
                build_mask(self.batch.positions[qs[i]:qs[i + 1]], kp, causal, window) for i, kp in enumerate(self.k_pos)
            ]
        return self._masks[key]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
        window: int | None,
    ) -> torch.Tensor:
        ck, cv = self.pool.draft_k[layer], self.pool.draft_v[layer]
        masks = self._mask(causal, window)
        out = torch.empty_like(q)
        qs = self.qs
        for i, context in enumerate(self.contexts):
            a, b = qs[i], qs[i + 1]
            keys, values = torch.cat([gather(ck, context), k[a:b]]), torch.cat([gather(cv, context), v[a:b]])
            out[a:b] = attend(q[a:b], keys, values, masks[i], scale)
        return out
