"""The DFlash loss over the target's (frozen) lm_head without ever holding all logits: w_r * CE(logits_r, y_r) per row.

Logits of 512 anchors x 16 slots x a 50k-150k vocabulary are gigabytes per sequence, so rows go through the lm_head
a chunk at a time and the gradient with respect to the hidden rows is formed right there (softmax - onehot, through
compute_logits' multiplier and softcap, back through the lm_head), leaving only [rows, H] for the backward pass.
The loss comes out per row, so a caller may weigh rows by what the forward itself found (backward scales their
gradient rows by the same factors).
The lm_head is frozen, so no weight gradient is needed. On CUDA the chunk function is compiled (fused softmax, no fp32
logits in memory) and chunks are padded to one size so it compiles once."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from blockspec.models.dflash_config import DFlashConfig

CHUNK_ELEMENTS = 1 << 27  # logits per chunk (256 MB in bf16)

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def chunk_rows(vocab_size: int) -> int:
    return max(128, CHUNK_ELEMENTS // vocab_size // 128 * 128)


def ce_chunk(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, multiplier: float,
             softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, H], weight [V, H] (lm_head), labels [N], w [N] -> (w * CE [N], d(w * CE)/dh [N, H], argmax hits [N]).
    The logits are those of DFlashDraftModel.compute_logits."""
    logits = F.linear(h.to(weight.dtype), weight).float()
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        t = torch.tanh(logits / softcap)
        logits = t * softcap
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, labels[:, None])[:, 0]) * w
    g = torch.exp(logits - lse[:, None]).scatter_add(1, labels[:, None], -torch.ones_like(logits[:, :1]))
    g = g * w[:, None]
    if softcap:
        g = g * (1 - t * t)
    if multiplier != 1.0:
        g = g * multiplier
    grad_h = F.linear(g.to(weight.dtype), weight.t()).to(h.dtype)
    return loss, grad_h, logits.argmax(-1) == labels


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, w, fn, chunk):  # type: ignore[override]
        grad = torch.empty_like(hidden)
        hits = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            losses[s:s + chunk], grad[s:s + chunk], hits[s:s + chunk] = fn(hidden[s:s + chunk], weight,
                                                                           labels[s:s + chunk], w[s:s + chunk])
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return losses, hits

    @staticmethod
    def backward(ctx, grad_losses, _grad_hits):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None


class BlockLoss:
    """Weighted CE of chosen block rows. compiled=True: the chunk function goes through torch.compile and the rows
    are padded (weight 0) to whole chunks, so every call has one shape."""

    def __init__(self, cfg: DFlashConfig, lm_head_weight: torch.Tensor, compiled: bool) -> None:
        self.weight = lm_head_weight.detach()
        self.chunk = chunk_rows(self.weight.shape[0])
        mult, cap = cfg.output_multiplier, cfg.final_logit_softcapping

        def fn(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
            return ce_chunk(h, weight, labels, w, mult, cap)

        self.fn: ChunkFn = torch.compile(fn, dynamic=False) if compiled else fn
        self.pad = compiled

    def __call__(self, hidden: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [Q, H]; rows [R] (rows to score); labels, weights [Q] -> (w * CE [R], hits [R])."""
        R = len(rows)
        if self.pad and R % self.chunk:
            rows = torch.cat([rows, rows.new_zeros(self.chunk - R % self.chunk)])
        w = weights[rows]
        if self.pad:
            w[R:] = 0.0
        losses, hits = _ChunkedCE.apply(hidden[rows], self.weight, labels[rows], w, self.fn, self.chunk)
        return losses[:R], hits[:R]
