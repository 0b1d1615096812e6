"""Short causal depthwise convolution with a kept window (Gated DeltaNet's conv over q|k|v, kernel K, typically 4).

Each channel c of row t mixes that channel's inputs at rows t-K+1 .. t: y[t, c] = silu(sum_j w[c, j] x[t-K+1+j, c]).
Across forwards a sequence keeps the K-1 inputs before its next row, its conv window [C, K-1] (oldest first; zeros
before the sequence's first row), so a prefill chunk, a decode row or a verify block continues exactly where the
last one stopped."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, keep_rows: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, C] new rows, window [B, C, K-1] the inputs before them, weight [C, 1, K] (HF's conv1d.weight).
    -> (silu(conv) [B, L, C], the window after the last row [B, C, K-1], or with keep_rows the window after each
    row [B, L, C, K-1]). Computed in the weight's dtype, as the reference model does."""
    L, C, K = x.shape[1], weight.shape[0], weight.shape[-1]
    seq = torch.cat([window.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)  # [B, C, K-1+L]
    y = F.silu(F.conv1d(seq, weight, groups=C))  # [B, C, L]: no padding, the window is the causal left context
    if keep_rows:  # the window after row t: the K-1 inputs ending at row t (seq index t + K - 1)
        kept = torch.stack([seq[:, :, t + 1:t + K] for t in range(L)], dim=1)
    else:
        kept = seq[:, :, seq.shape[-1] - (K - 1):]
    return y.transpose(1, 2).to(x.dtype), kept


class ShortConv(nn.Module):
    """The depthwise kernel as a parameter named as in the checkpoint (`conv1d.weight` [C, 1, K], no bias)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.normal_(self.weight, std=kernel ** -0.5)

    def forward(self, x: torch.Tensor, window: torch.Tensor, keep_rows: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv(x, window, self.weight, keep_rows)
