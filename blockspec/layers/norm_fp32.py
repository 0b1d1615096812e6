"""RMSNorm with the weight applied in fp32 before the one cast back, and optionally no weight at all.

layers/norm.py rounds the normalized activations to the model's dtype and then multiplies by the weight in that dtype
(Llama / Qwen's RMSNorm). gpt-oss keeps its norms' weights in fp32 and multiplies before rounding (HF loads them in
fp32: `_keep_in_fp32_modules`), and Gemma 4's norms compute `(x_normed * weight.float()).type_as(x)`; Gemma 4 also has
weightless norms (the value norm, the router's input norm). In fp32 every variant is the same arithmetic; in bf16 this
one rounds once where layers/norm.py rounds twice, as those checkpoints' reference does."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., dim] -> normalized over the last dim in fp32, times `weight` in fp32 (None: no weight), cast back."""
    if weight is not None and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)  # one eager call; the formula below, bit for bit
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = xf * weight.float()
    return xf.to(x.dtype)


class Fp32RMSNorm(nn.Module):
    """`weight` [dim] (HF's name) unless with_scale=False; forward and add_forward as layers/norm.RMSNorm's."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add with the norm after it: (norm(residual + x), residual + x)."""
        h = residual + x
        return self(h), h
