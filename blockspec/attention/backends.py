"""Attention backends over the paged pool, chosen by name: "torch" (reference, any device) or "triton" (GPU
kernels; on CPU only under TRITON_INTERPRET=1, for tests). A backend is a target attention, a draft attention and
a KV store, each built over one PagedBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from blockspec.attention import paged_ref
from blockspec.attention.paged_ref import (PagedBatch, PagedDraftAttention, PagedTargetAttention,
                                           RowwiseTargetAttention)
from blockspec.errors import ConfigError
from blockspec.kv.pool import KVPool
from blockspec.models.base import AttentionBase, PagedDest

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class _TritonPaged:
    """The Triton kernels over one forward's pool and batch."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        from blockspec.attention import triton_paged

        self.ops, self.pool, self.batch = triton_paged, pool, batch


class TritonTargetAttention(_TritonPaged, AttentionBase):
    batch_invariant = False  # the deterministic kernel mode (triton_paged.paged_attention(batch_invariant=True))

    def kv_destination(self, layer: int) -> PagedDest:
        """Where this layer's new k/v rows go, for a model prologue that stores them itself (one launch less)."""
        return self.pool.k[layer], self.pool.v[layer], self.batch.slot_mapping

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """As the reference's (paged_ref.PagedTargetAttention): `window` for a sliding-window layer, `sinks` [Hq]
        for learned attention sinks (gpt-oss); k = v = None stores nothing (written by the prologue already, or a
        layer reading the cache of the layer it shares K/V with: Gemma 4)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        b = self.batch
        if k is not None and v is not None:
            self.ops.store_kv(k, v, kc, vc, b.slot_mapping)
        return self.ops.paged_attention(q, kc, vc, b.positions, b.query_start, b.kv_lens, b.block_tables,
                                        self.pool.block_size, scale, b.max_q_len, causal=True, window=window,
                                        max_kv_len=b.max_kv_len, batch_invariant=self.batch_invariant, sinks=sinks)


class InvariantTargetAttention(TritonTargetAttention):
    batch_invariant = True


class TritonDraftAttention(_TritonPaged):
    """The block's own k/v are never stored: they join the cached context inside the kernel."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 causal: bool, window: int | None) -> torch.Tensor:
        b = self.batch
        return self.ops.paged_attention(q, self.pool.draft_k[layer], self.pool.draft_v[layer], b.positions,
                                        b.query_start, b.kv_lens, b.block_tables, self.pool.block_size, scale,
                                        b.max_q_len, causal=causal, window=window, k_new=k, v_new=v,
                                        max_kv_len=b.max_kv_len)


def _triton_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slots: torch.Tensor) -> None:
    from blockspec.attention.triton_paged import store_kv

    store_kv(k, v, k_cache, v_cache, slots)


@dataclass(frozen=True)
class AttentionBackend:
    target: Callable[[KVPool, PagedBatch], object]  # -> AttentionFn
    draft: Callable[[KVPool, PagedBatch], object]  # -> DraftAttentionFn
    store: StoreFn  # (k_cache, v_cache, k, v, slots): write rows, slot -1 skipped
    capturable: bool  # no host sync inside: usable in a CUDA graph


BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend(PagedTargetAttention, PagedDraftAttention, paged_ref.store, capturable=False),
    "triton": AttentionBackend(TritonTargetAttention, TritonDraftAttention, _triton_store, capturable=True),
}
# The target's attention in the deterministic mode, for batch-invariant targets (LoadConfig(batch_invariant=True));
# the drafter's attention need not be: drafts only change which tokens are proposed, never which are output.
INVARIANT = AttentionBackend(InvariantTargetAttention, TritonDraftAttention, _triton_store, capturable=True)


# The reference target attention with each decode / verify row computed as a one-row decode step, for targets whose
# linears round activations to bf16 (the quantized CPU kernels: LoadedModel.row_invariant).
ROWWISE = AttentionBackend(RowwiseTargetAttention, PagedDraftAttention, paged_ref.store, capturable=False)


def backend_name(name: str, device: torch.device, batch_invariant: bool = False, row_invariant: bool = False) -> str:
    """The backend a target runs given the asked `name` (auto | torch | triton), its device and what its linears need:
    "triton" or "torch" as asked ("auto": Triton on CUDA), "rowwise" (the reference with each decode / verify row
    computed as a one-row step, for targets whose linears round activations to bf16: the quantized CPU kernels) or
    "invariant" (the Triton target attention in its deterministic mode, for batch-invariant targets). The platform
    plan reports this (loading/platform.py); get_backend builds it: one decision."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend={name!r}: expected one of auto, {', '.join(BACKENDS)}")
    if row_invariant and name == "torch":
        return "rowwise"
    if batch_invariant:
        if name != "triton":
            raise ConfigError(f"a batch-invariant target needs attention_backend='triton' (or 'auto' on CUDA), "
                              f"got {name!r}")
        return "invariant"
    return name


def get_backend(name: str, device: torch.device, batch_invariant: bool = False,
                row_invariant: bool = False) -> AttentionBackend:
    chosen = backend_name(name, device, batch_invariant, row_invariant)
    return {"rowwise": ROWWISE, "invariant": INVARIANT}.get(chosen) or BACKENDS[chosen]
