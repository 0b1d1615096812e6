"""Reference attention in plain torch: the correctness oracle for every faster backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None = None
) -> torch.Tensor:
    """Boolean mask [T, S]: True where query at q_pos may see key at k_pos.
    causal: k_pos <= q_pos. window W: causal -> q_pos - k_pos < W; non-causal -> |q_pos - k_pos| < W."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        mask = mask & (diff.abs() < window)
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D], mask [T, S] -> [T, Hq, D]. GQA by repeating kv heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None], scale=scale
    )
    return out.transpose(0, 1)
