"""What every target model returns from one forward, and the attention callable it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

PagedDest = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k_cache, v_cache [num_slots, Hkv, D], slot_mapping [N])


class AttentionFn(Protocol):
    """Stores this forward's k/v for `layer` and returns attention output. q [T, Hq, D], k/v [T, Hkv, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor: ...

    def kv_destination(self, layer: int) -> PagedDest | None:
        """Where a model's fused prologue may write this layer's new k/v itself (it then passes k = v = None), or
        None: the attention stores the k/v it is given."""
        ...


class AttentionBase:
    """The base of AttentionFn implementations: no destination offered, so models always pass k and v."""

    def kv_destination(self, layer: int) -> PagedDest | None:
        return None


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [R, vocab] at the requested rows (fp32)
    taps: torch.Tensor | None  # [T, len(tap_layers) * hidden]: residual stream after each tapped layer, concatenated
    hidden: torch.Tensor  # [T, hidden] final-normed hidden states


def packed_shard_sizes(config, param: str) -> list[int]:
    """Row sizes of the shards packed into a fused parameter (qkv_proj: q, k, v; gate_up_proj: gate, up) of a
    decoder layer with `config`'s shape (a target's ModelConfig or a drafter's config): for the loaders and export."""
    if "qkv_proj" in param:
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]
