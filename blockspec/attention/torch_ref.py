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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D], mask [T, S] (None: every key) -> [T, Hq, D]. GQA through SDPA's enable_gqa:
    on CPU about 4x faster than repeating the kv heads (36 vs 157 us for a decode row over 200 keys, 9 q / 3 kv
    heads)."""
    # 4-D [1, H, T, D]: with 3-D inputs SDPA takes its slow math path on CPU
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
