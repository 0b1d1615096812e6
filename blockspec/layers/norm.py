"""RMSNorm, computed in fp32 and cast back (as HF does, so bf16 results match it); one Triton kernel on CUDA."""

import torch
from torch import nn

from blockspec.layers import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype, times `weight` (which may broadcast against x:
    the CPU bf16 drafter normalizes the q and k heads of a block, each with its own weight, in one call)."""
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        # torch's composite rms_norm on CPU: the same ops in the same order (equal bit for bit: tests/test_models.py)
        # in one eager call instead of seven, which are much of a small CPU decode step's cost
        return torch.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused(x) and x.dtype == self.weight.dtype:  # no backward in Triton
            from blockspec.layers.triton_norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused with the norm after it: (norm(residual + x), residual + x)."""
        if kernels.fused(x) and x.dtype == self.weight.dtype:
            from blockspec.layers.triton_norm import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h
