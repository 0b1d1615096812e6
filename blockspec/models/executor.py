"""The layer-stack executor seam: an object a model may hold (`model.executor`, None by default) that runs the model's
whole layer stack in one call in place of the model's own layer loop, where it can. The native q4 stack on the CPU is
one (loading/native_stack.py attaches it at load). Each forward the model asks it first; it answers None where it does
not run the attention it is given (another backend, another pool dtype), and the model's own layers run. So which path
ran depends on one explicit object, typed here, and models/ knows nothing of what implements it."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.base import AttentionFn, PagedDest


class TargetStackExecutor(Protocol):
    """Runs a target's layers and final norm (DecoderForCausalLM); the embedding and the logits stay the model's."""

    def run_layers(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                   tap_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """embeds [T, H], cos / sin [T, 1, D] (the rotary table at the rows' positions) -> (final-normed hidden
        [T, H], taps [T, len(tap_layers) * H] or None), the rows' k / v stored where `attn` keeps them; None where it
        does not run `attn`."""
        ...


class DraftStackExecutor(Protocol):
    """Runs a DFlash drafter's layers and final norm, and its context append (DFlashDraftModel)."""

    # attn: models/dflash.py's DraftAttentionFn (typed loosely here: that module imports this one)
    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Callable[..., torch.Tensor],
                   outputs: tuple[int, int] | None) -> torch.Tensor | None:
        """h [T, H] (the blocks' scaled embeddings), cos / sin [T, 1, D] -> final-normed hidden [T, H]; outputs (a, b):
        only rows a..b-1 of each block need be right (the others may be zeros). None where it does not run `attn`."""
        ...

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      paged: Callable[[int], PagedDest]) -> bool:
        """taps [N, num_taps * H] of committed rows at `positions` [N] -> every layer's context k / v written into
        paged(layer)'s caches at its slots: True, or False where it does not write those caches (the model then
        computes the k / v itself)."""
        ...
