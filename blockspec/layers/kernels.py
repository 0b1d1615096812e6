"""When the fused Triton kernels serve a tensor: on CUDA, outside autograd (they have no backward).

Tests set INTERPRET_ON_CPU (with TRITON_INTERPRET=1) to run the very same fused code paths on CPU tensors, slowly,
so the model-level use of the kernels is checked against the torch path without a GPU."""

from __future__ import annotations

import torch

INTERPRET_ON_CPU = False


def fused(x: torch.Tensor) -> bool:
    return (x.is_cuda or INTERPRET_ON_CPU) and not torch.is_grad_enabled()


def fused_device(device: torch.device) -> bool:
    """Whether models on `device` take the fused paths (for set-up done once, e.g. packing weights)."""
    return device.type == "cuda" or INTERPRET_ON_CPU
