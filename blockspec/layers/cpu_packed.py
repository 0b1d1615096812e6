"""bf16 linears pre-packed for oneDNN on the CPU (AMX / AVX512-BF16): the drafter's CPU fast path.

On a CPU a decode step is bound by weight bytes, and MKL's fp32 kernels run at about half rate for the drafter's
16-row blocks (docs/perf.md). The drafter only proposes tokens: the target verifies them in its own precision, so
a bf16 drafter can change acceptance, never the output. F.linear in bf16 re-packs the weight into oneDNN's blocked
layout on every call (no faster than fp32 at one row); these linears pack it once, at load. Inference only: the
packed weight has no autograd, and it is a plain attribute that .to() leaves alone (it stays on the CPU)."""

from __future__ import annotations

import torch
from torch import nn


def supported(device: torch.device) -> bool:
    """Whether `device` is a CPU with oneDNN bf16 kernels (AVX512-BF16 or AMX)."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinearBF16(nn.Module):
    """y = x @ weight.T + bias with the weight in bf16, packed once for oneDNN; x [..., in] of any float dtype is
    cast to bf16, y is bf16 [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 16) -> None:
        super().__init__()
        w = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = w.shape
        # rows_hint: the typical number of input rows, which oneDNN uses to pick the blocked layout (any row count
        # works)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear, rows_hint: int = 16) -> "PackedLinearBF16":
        return cls(linear.weight, linear.bias, rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module, rows_hint: int = 16) -> None:
    """Replace every nn.Linear under `module`, in place, by a PackedLinearBF16 (subclasses, e.g. tensor-parallel
    shards, are left alone)."""
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinearBF16.from_linear(child, rows_hint))
        else:
            pack_linears(child, rows_hint)
