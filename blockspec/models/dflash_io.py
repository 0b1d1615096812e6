"""The DFlash drafter's boundary with its target, in the variants picked once at load (loading/prepare.py): how the
target's taps and embeddings enter the drafter, and which head turns its hidden states into logits.

The drafter has no embedding or lm_head of its own: by default it reads the target's tensors as they come and drafts
through the target's lm_head, passed at every call. A drafter packed for the CPU in another dtype than its target
casts what comes in, and drafts through a packed copy of the head; argmax drafts over the token ids < n only
(draft_vocab_size) use the first n rows of the head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Cast(nn.Module):
    """Inputs cast into the drafter's dtype (e.g. bf16 under an fp32 target)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


class DraftHead(nn.Module):
    """Logits through the target's lm_head, as passed: no copy."""

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(hidden)


class OwnHead(DraftHead):
    """Logits through a head the drafter holds itself, made from the target's at load (the target's is ignored)."""

    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return self.proj(hidden)


class VocabPrefixHead(nn.Module):
    """Logits over the token ids < n only: the first n rows of an lm_head, as a view made once at load (a static
    weight for captured CUDA graphs; a non-persistent buffer, so .to(device) moves it with the drafter)."""

    def __init__(self, lm_head: nn.Module, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", lm_head.weight.detach()[:n], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
