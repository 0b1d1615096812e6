"""What every target model returns from one forward, and the attention callable it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class AttentionFn(Protocol):
    """Stores this forward's k/v for `layer` and returns attention output. q [T, Hq, D], k/v [T, Hkv, D].

    An attention over a paged pool may also offer `kv_destination(layer) -> (k_cache, v_cache, slot_mapping)`: a
    model whose fused prologue writes k/v into those caches itself then passes k = v = None."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor: ...


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [R, vocab] at the requested rows (fp32)
    taps: torch.Tensor | None  # [T, len(tap_layers) * hidden]: residual stream after each tapped layer, concatenated
    hidden: torch.Tensor  # [T, hidden] final-normed hidden states
