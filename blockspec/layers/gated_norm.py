"""The two RMSNorm variants of the Qwen3.5 hybrids, both computed in fp32 as the reference model does.

- OffsetRMSNorm: scale (1 + weight), the weight stored zero-centred (the layer norms, the final norm and the full
  attention's per-head q/k norms of Qwen3.5 / Qwen3-Next), multiplied in fp32 before the cast back.
- GatedRMSNorm: weight * rmsnorm(x), then times silu(gate) in fp32 (the linear-attention output, gated by z)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.norm import rms_norm


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.rms_norm(x, scale.shape, scale, self.eps)  # the same ops as below, one eager call
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), as RMSNorm.add_forward."""
        h = residual + x
        return self(h), h


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] -> weight * rmsnorm(x) * silu(gate), in x's dtype."""
        return (rms_norm(x, self.weight, self.eps) * F.silu(gate.float())).to(x.dtype)
