"""The DFlash loss over the target's (frozen) lm_head without ever holding all logits: w_r * CE(logits_r, y_r) per row.

Logits of 512 anchors x 16 slots x a 50k-150k vocabulary are gigabytes per sequence, so rows go through the lm_head
a chunk at a time and the gradient with respect to the hidden rows is formed right there (softmax - onehot, through
compute_logits' multiplier and softcap, back through the lm_head), leaving only [rows, H] for the backward pass.
The loss comes out per row, so a caller may weigh rows by what the forward itself found (backward scales their
gradient rows by the same factors).
With distillation (--distill-weight W) the label of a row is (1 - W) onehot + W p, p the target's own next-token
distribution at the position before the label (its final hidden row through the same lm_head, in the same chunk).
The lm_head is frozen, so no weight gradient is needed. On CUDA the chunk function is compiled (fused softmax, no fp32
logits in memory) and chunks are padded to one size so it compiles once.
For a DFlash 2 drafter the same chunks also hand back each row's top-k logits and their token ids (the candidate
selector's candidates and unary scores, formed as at inference), so its loss (train/selector_loss.py) needs no second
pass through the lm_head."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from blockspec.models.dflash_config import DFlashConfig

CHUNK_ELEMENTS = 1 << 27  # logits per chunk (256 MB in bf16)

ChunkFn = Callable[..., tuple[torch.Tensor, ...]]
Candidates = tuple[torch.Tensor, torch.Tensor]  # [R, k] fp32 logits (no grad) and [R, k] their token ids


def chunk_rows(vocab_size: int) -> int:
    return max(128, CHUNK_ELEMENTS // vocab_size // 128 * 128)


def _logits(x: torch.Tensor, weight: torch.Tensor, multiplier: float, softcap: float | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits as DFlashDraftModel.compute_logits forms them, and tanh(z / softcap) for the chain rule."""
    z = F.linear(x.to(weight.dtype), weight).float()
    if multiplier != 1.0:
        z = z * multiplier
    t = None
    if softcap:
        t = torch.tanh(z / softcap)
        z = t * softcap
    return z, t


def _grad_h(g: torch.Tensor, t: torch.Tensor | None, weight: torch.Tensor, multiplier: float, dtype: torch.dtype
            ) -> torch.Tensor:
    """d loss / d logits [N, V] -> d loss / d h [N, H], back through the softcap, the multiplier and the lm_head."""
    if t is not None:
        g = g * (1 - t * t)
    if multiplier != 1.0:
        g = g * multiplier
    return F.linear(g.to(weight.dtype), weight.t()).to(dtype)


def _top(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """() or (values [N, k], ids [N, k]): sorted, as CandidateSelector.candidates takes them at inference."""
    return tuple(torch.topk(logits, top_k, dim=-1, sorted=True)) if top_k else ()


def ce_chunk(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, multiplier: float,
             softcap: float | None, top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """h [N, H], weight [V, H] (lm_head), labels [N], w [N] -> (w * CE [N], d(w * CE)/dh [N, H], argmax hits [N]),
    and with top_k the top-k logits and their ids [N, k]. The logits are those of DFlashDraftModel.compute_logits."""
    logits, t = _logits(h, weight, multiplier, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, labels[:, None])[:, 0]) * w
    g = torch.exp(logits - lse[:, None]).scatter_add(1, labels[:, None], -torch.ones_like(logits[:, :1]))
    return (loss, _grad_h(g * w[:, None], t, weight, multiplier, h.dtype), logits.argmax(-1) == labels,
            *_top(logits, top_k))


def soft_ce_chunk(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, target_h: torch.Tensor,
                  alpha: float, multiplier: float, softcap: float | None, top_k: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    """ce_chunk against the mixed label y = (1 - alpha) * onehot(label) + alpha * p, where p is the target's own
    next-token distribution (its final hidden rows target_h [N, H] through the same lm_head): the loss is
    w * (lse - <y, logits>) and its gradient w * (softmax - y), so the drafter also learns how the target ranks the
    tokens it did not pick. hits stay argmax == label."""
    logits, t = _logits(h, weight, multiplier, softcap)
    y = torch.softmax(_logits(target_h, weight, multiplier, softcap)[0], dim=-1) * alpha
    y = y.scatter_add(1, labels[:, None], torch.full_like(logits[:, :1], 1.0 - alpha))
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - (y * logits).sum(-1)) * w
    g = (torch.exp(logits - lse[:, None]) - y) * w[:, None]
    return loss, _grad_h(g, t, weight, multiplier, h.dtype), logits.argmax(-1) == labels, *_top(logits, top_k)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, w, fn, chunk, target_h, top_k):  # type: ignore[override]
        N, dev = hidden.shape[0], hidden.device
        grad = torch.empty_like(hidden)
        hits = torch.empty(N, dtype=torch.bool, device=dev)
        losses = torch.empty(N, dtype=torch.float32, device=dev)
        top_v = torch.empty(N, top_k, dtype=torch.float32, device=dev)
        top_i = torch.empty(N, top_k, dtype=torch.long, device=dev)
        outs = (losses, grad, hits, top_v, top_i) if top_k else (losses, grad, hits)
        for s in range(0, N, chunk):
            extra = () if target_h is None else (target_h[s:s + chunk],)
            for out, part in zip(outs, fn(hidden[s:s + chunk], weight, labels[s:s + chunk], w[s:s + chunk], *extra)):
                out[s:s + chunk] = part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits, top_v, top_i)
        return losses, hits, top_v, top_i

    @staticmethod
    def backward(ctx, grad_losses, *_grad_rest):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None, None, None


class BlockLoss:
    """Weighted CE of chosen block rows. compiled=True: the chunk function goes through torch.compile and the rows
    are padded (weight 0) to whole chunks, so every call has one shape. top_k > 0 (DFlash 2): scored() also returns
    every scored row's top-k candidates."""

    def __init__(self, cfg: DFlashConfig, lm_head_weight: torch.Tensor, compiled: bool, distill: float = 0.0,
                 top_k: int = 0) -> None:
        self.weight = lm_head_weight.detach()
        self.chunk = chunk_rows(self.weight.shape[0])
        self.distill, self.top_k = distill, top_k
        mult, cap = cfg.output_multiplier, cfg.final_logit_softcapping

        def fn(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
            return ce_chunk(h, weight, labels, w, mult, cap, top_k)

        def soft_fn(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, w: torch.Tensor,
                    target_h: torch.Tensor):
            return soft_ce_chunk(h, weight, labels, w, target_h, distill, mult, cap, top_k)

        chosen = soft_fn if distill > 0 else fn
        self.fn: ChunkFn = torch.compile(chosen, dynamic=False) if compiled else chosen
        self.pad = compiled

    def __call__(self, hidden: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 target_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [Q, H]; rows [R] (rows to score); labels, weights [Q]; with distill > 0 target_h [R, H], the
        target's final hidden row before each scored row's label -> (w * loss [R], hits [R])."""
        return self.scored(hidden, rows, labels, weights, target_h)[:2]

    def scored(self, hidden: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               target_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, Candidates | None]:
        """As __call__, plus the scored rows' candidates when top_k > 0 (else None)."""
        R = len(rows)
        if (target_h is None) != (self.distill == 0):
            raise ValueError("target_h is needed exactly when distill > 0")
        if self.pad and R % self.chunk:
            pad = self.chunk - R % self.chunk
            rows = torch.cat([rows, rows.new_zeros(pad)])
            if target_h is not None:
                target_h = torch.cat([target_h, target_h.new_zeros(pad, target_h.shape[1])])
        w = weights[rows]
        if self.pad:
            w[R:] = 0.0
        losses, hits, top_v, top_i = _ChunkedCE.apply(hidden[rows], self.weight, labels[rows], w, self.fn,
                                                      self.chunk, target_h, self.top_k)
        return losses[:R], hits[:R], ((top_v[:R], top_i[:R]) if self.top_k else None)
