"""The paged KV pool: fixed-size blocks for every target layer AND every draft layer.

One block id addresses both: the draft-context K/V of the token at position p lives in the same block/slot as the
target K/V of that token, so one block table per sequence serves both models, memory grows with live tokens only,
and a prefix-cache hit restores both at once. Slot = block_id * block_size + offset; slot -1 means "do not write"."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVPool:
    def __init__(
        self, num_blocks: int, block_size: int, target: CacheShape, draft: CacheShape | None,
        dtype: torch.dtype, device: torch.device, draft_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the target's K/V; draft_dtype: the draft context's (None: dtype), which differs when the drafter
        runs in another precision than the target (SpeculativeConfig.cpu_bf16_draft)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.target_shape, self.draft_shape = target, draft
        # [layers, num_blocks * block_size, kv_heads, head_dim]: slots flattened, pages are views of block_size rows
        slots = num_blocks * block_size
        self.k = torch.zeros(target.num_layers, slots, target.num_kv_heads, target.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        if draft is not None:
            self.draft_k = torch.zeros(draft.num_layers, slots, draft.num_kv_heads, draft.head_dim,
                                       dtype=draft_dtype or dtype, device=device)
            self.draft_v = torch.zeros_like(self.draft_k)
        else:
            self.draft_k = self.draft_v = None

    def draft_pool(self) -> KVPool:
        """The proposer's K/V as a pool of its own (same slots, no copy): what the target-style attentions read as
        `k` / `v` when a proposer's model is a decoder (a classic draft model) rather than the target."""
        view = object.__new__(KVPool)
        view.num_blocks, view.block_size = self.num_blocks, self.block_size
        view.target_shape, view.draft_shape = self.draft_shape, None
        view.k, view.v, view.draft_k, view.draft_v = self.draft_k, self.draft_v, None, None
        return view

    @staticmethod
    def bytes_per_token(target: CacheShape, draft: CacheShape | None, dtype: torch.dtype,
                        draft_dtype: torch.dtype | None = None) -> int:
        """2 (K and V) x sum over models of layers x kv_heads x head_dim x element size."""
        size = lambda t: torch.empty((), dtype=t).element_size()  # noqa: E731
        total = target.num_layers * target.num_kv_heads * target.head_dim * size(dtype)
        if draft is not None:
            total += draft.num_layers * draft.num_kv_heads * draft.head_dim * size(draft_dtype or dtype)
        return 2 * total

    def nbytes(self) -> int:
        tensors = [self.k, self.v] + ([self.draft_k, self.draft_v] if self.draft_k is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
