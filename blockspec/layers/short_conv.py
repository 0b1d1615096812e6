"""Short causal depthwise convolution with a kept window (Gated DeltaNet's conv over q|k|v, kernel K, typically 4).

Each channel c of row t mixes that channel's inputs at rows t-K+1 .. t: y[t, c] = silu(sum_j w[c, j] x[t-K+1+j, c]).
Across forwards a sequence keeps the K-1 inputs before its next row, its conv window [C, K-1] (oldest first; zeros
before the sequence's first row), so a prefill chunk, a decode row or a verify block continues exactly where the
last one stopped; after a verify block whose first n + 1 rows are accepted, the window is the K-1 inputs ending at
row n (`window_after`), whatever came after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, C] new rows, window [B, C, K-1] the inputs before them, weight [C, 1, K] (HF's conv1d.weight).
    -> (silu(conv) [B, L, C], the window after the last row [B, C, K-1]). Computed in the weight's dtype, as the
    reference model does."""
    C, K = weight.shape[0], weight.shape[-1]
    seq = torch.cat([window.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, K-1+L]
    y = F.silu(F.conv1d(seq, weight, groups=C))  # [B, C, L]: no padding, the window is the causal left context
    return y.transpose(1, 2).to(x.dtype), seq[:, :, seq.shape[-1] - (K - 1):]


def window_after(window: torch.Tensor, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The window after row n[b] of x: window [B, C, W] (W = K-1) the inputs before x [B, L, C]; n [B] int64 in
    [0, L). -> [B, C, W], the W inputs ending at row n of (window ++ x), in the window's dtype. One gather: fixed
    shapes, no host sync (n stays on the device)."""
    B, C, W = window.shape
    seq = torch.cat([window, x.transpose(1, 2).to(window.dtype)], dim=-1)  # [B, C, W + L]; row t at W + t
    at = (n[:, None] + 1 + torch.arange(W, device=n.device)).view(B, 1, W).expand(B, C, W)
    return seq.gather(2, at)


class ShortConv(nn.Module):
    """The depthwise kernel as a parameter named as in the checkpoint (`conv1d.weight` [C, 1, K], no bias)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.normal_(self.weight, std=kernel ** -0.5)

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv(x, window, self.weight)
