"""Reference attention over the paged pool (plain torch, CPU and GPU): the oracle for the Triton kernels.

A batch is a flat [T] run of new tokens, sequence after sequence (varlen). Each sequence sees the keys at positions
< kv_len through its block table, then masks by position (causal for the target; causal / non-causal / windowed per
draft layer). Loops over sequences on the host: clarity over speed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.torch_ref import attend, build_mask
from blockspec.kv.pool import KVPool
from blockspec.models.base import AttentionBase


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


def store(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache_* [slots, Hkv, D]; k, v [T, Hkv, D]; rows with slot -1 are skipped."""
    keep = slots >= 0
    if bool(keep.all()):
        cache_k[slots], cache_v[slots] = k, v
    else:
        cache_k[slots[keep]], cache_v[slots[keep]] = k[keep], v[keep]


class PagedTargetAttention(AttentionBase):
    """Causal attention of the batch's new tokens over each sequence's paged context (AttentionFn)."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self.qs, kv_lens = batch.host_lists()
        self.gather = [batch.context_slots(i, n, pool.block_size) for i, n in enumerate(kv_lens)]
        self.masks = []
        for i, n in enumerate(kv_lens):
            q_pos = batch.positions[self.qs[i]:self.qs[i + 1]]
            self.masks.append(build_mask(q_pos, torch.arange(n, device=q_pos.device), causal=True))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ck, cv = self.pool.k[layer], self.pool.v[layer]
        store(ck, cv, k, v, self.batch.slot_mapping)
        out = torch.empty_like(q)
        qs = self.qs
        for i, slots in enumerate(self.gather):
            out[qs[i]:qs[i + 1]] = attend(q[qs[i]:qs[i + 1]], ck[slots], cv[slots], self.masks[i], scale)
        return out


class PagedDraftAttention:
    """Draft block attention: each sequence's block rows over its cached draft context (positions < kv_len, which
    is the block's start) plus the block's own K/V, masked per layer (DraftAttentionFn)."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch
        self.qs, kv_lens = batch.host_lists()
        self.gather = [batch.context_slots(i, n, pool.block_size) for i, n in enumerate(kv_lens)]
        self.k_pos = []
        for i, n in enumerate(kv_lens):
            q_pos = batch.positions[self.qs[i]:self.qs[i + 1]]
            self.k_pos.append(torch.cat([torch.arange(n, device=q_pos.device), q_pos]))
        self._masks: dict[tuple[bool, int | None], list[torch.Tensor]] = {}

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
        for i, slots in enumerate(self.gather):
            a, b = qs[i], qs[i + 1]
            keys, values = torch.cat([ck[slots], k[a:b]]), torch.cat([cv[slots], v[a:b]])
            out[a:b] = attend(q[a:b], keys, values, masks[i], scale)
        return out
