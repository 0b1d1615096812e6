"""A contiguous per-request KV cache: the simple cache of the single-request reference path.

Positions index the cache directly. Rewinding after a rejected draft needs no work: a query at position p only
sees keys at positions <= p, and those are always rewritten before they are read again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.torch_ref import attend, build_mask
from blockspec.models.base import AttentionBase


@dataclass
class DenseKVCache:
    k: torch.Tensor  # [num_layers, max_len, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_layers, max_len, num_kv_heads, head_dim]

    @classmethod
    def allocate(
        cls, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> "DenseKVCache":
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[1]


class DenseCausalAttention(AttentionBase):
    """Causal attention of new tokens at `positions` over everything cached at positions <= theirs."""

    def __init__(self, cache: DenseKVCache, positions: torch.Tensor, kv_len: int) -> None:
        self.cache = cache
        self.positions = positions  # [T]
        self.kv_len = kv_len  # 1 + highest position in this forward (host int: reference path only)
        k_pos = torch.arange(kv_len, device=positions.device)
        self.mask = build_mask(positions, k_pos, causal=True)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.k[layer, self.positions] = k
        self.cache.v[layer, self.positions] = v
        return attend(q, self.cache.k[layer, : self.kv_len], self.cache.v[layer, : self.kv_len], self.mask, scale)


class DenseDraftAttention:
    """Draft block attention: block queries over the cached context (positions < ctx_len) and the block itself."""

    def __init__(self, ctx_cache: DenseKVCache, ctx_len: int, block_positions: torch.Tensor) -> None:
        self.ctx_cache = ctx_cache
        self.ctx_len = ctx_len
        self.q_pos = block_positions  # [T]
        self.k_pos = torch.cat([torch.arange(ctx_len, device=block_positions.device), block_positions])

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
        window: int | None,
    ) -> torch.Tensor:
        keys = torch.cat([self.ctx_cache.k[layer, : self.ctx_len], k])
        values = torch.cat([self.ctx_cache.v[layer, : self.ctx_len], v])
        return attend(q, keys, values, build_mask(self.q_pos, self.k_pos, causal, window), scale)
