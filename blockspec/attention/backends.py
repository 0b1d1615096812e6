"""Attention backends over the paged pool, chosen by name: "torch" (reference, any device) or "triton" (GPU
kernels; on CPU only under TRITON_INTERPRET=1, for tests)."""

from __future__ import annotations

from typing import Callable

import torch

from blockspec.attention.paged_ref import PagedBatch, PagedDraftAttention, PagedTargetAttention
from blockspec.errors import ConfigError
from blockspec.kv.pool import KVPool


class TritonTargetAttention:
    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        from blockspec.attention import triton_paged

        self.ops, self.pool, self.batch = triton_paged, pool, batch
        dev = batch.positions.device
        self.qs = torch.tensor(batch.query_start, dtype=torch.int32, device=dev)
        self.kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int32, device=dev)
        self.max_q = max(b - a for a, b in zip(batch.query_start, batch.query_start[1:]))
        self.max_kv = max(batch.kv_lens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        self.ops.store_kv(k, v, kc, vc, self.batch.slot_mapping)
        return self.ops.paged_attention(q, kc, vc, self.batch.positions, self.qs, self.kv_lens, self.batch.block_tables,
                                        self.pool.block_size, scale, self.max_q, causal=True, max_kv_len=self.max_kv)


class TritonDraftAttention(TritonTargetAttention):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,  # type: ignore[override]
                 causal: bool, window: int | None) -> torch.Tensor:
        return self.ops.paged_attention(q, self.pool.draft_k[layer], self.pool.draft_v[layer], self.batch.positions,
                                        self.qs, self.kv_lens, self.batch.block_tables, self.pool.block_size, scale,
                                        self.max_q, causal=causal, window=window, k_new=k, v_new=v,
                                        max_kv_len=self.max_kv)


BACKENDS: dict[str, tuple[Callable, Callable]] = {
    "torch": (PagedTargetAttention, PagedDraftAttention),
    "triton": (TritonTargetAttention, TritonDraftAttention),
}


def get_backend(name: str, device: torch.device) -> tuple[Callable, Callable]:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend={name!r}: expected one of auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]
