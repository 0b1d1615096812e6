"""Linears pre-packed for oneDNN on the CPU: the CPU fast path of the target (in its own dtype) and of the drafter
(bf16, or the target's dtype).

On a CPU a decode step is bound by weight bytes, and MKL's GEMMs, which F.linear calls, read them slowly at the few
rows a decode or verify step has: on an AMD EPYC an fp32 GEMM of 3 rows takes ~3x the time of 1 row, and one row
over SmolLM2's lm_head ~2.5x what oneDNN takes (docs/results/2026-12-03-cpu-demo-bundled-pair.md). oneDNN on a weight
packed once into its blocked
layout reads it at near memory speed for 1 to 16 rows, so a verify step of K + 1 rows costs about what a 1-row step
does. F.linear in bf16 goes to oneDNN too but re-packs the weight on every call; these linears pack it once, at load.
Inference only: the packed weight has no autograd, and it is a plain attribute that .to() leaves alone (it stays on
the CPU)."""

from __future__ import annotations

import functools

import torch
from torch import nn

# rows oneDNN packs the target's weights for: its blocked layout for 16 rows serves 1-16 (plain decode, verify of
# K + 1 <= 16 rows) at the 1-row speed; a 1-row layout makes 3 rows ~2x slower (measured,
# docs/results/2026-12-03-cpu-demo-bundled-pair.md)
TARGET_ROWS_HINT = 16


def fp32_supported(device: torch.device) -> bool:
    """Whether `device` is a CPU with oneDNN (fp32 packed linears)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and _packs(torch.float32)


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` is a CPU with oneDNN bf16 kernels (AVX512-BF16 or AMX)."""
    return (fp32_supported(device) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and _packs(torch.bfloat16))


@functools.lru_cache(maxsize=None)
def _packs(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs a linear in `dtype`: the ops are private, and builds whose oneDNN
    lacks them (e.g. some non-x86 ones) must fall back to F.linear rather than fail at load."""
    try:
        eye = torch.eye(8, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(eye[:3], torch.ops.mkldnn._reorder_linear_weight(eye, 3), None,
                                               "none", [], "")
        return bool(torch.equal(y, eye[:3]))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias with the weight in `dtype` (fp32 or bf16), packed once for oneDNN; x [..., in] of any
    float dtype is cast to `dtype`, y is `dtype` [..., out]. keep_weight: `.weight` stays the original parameter
    (for readers of it such as the drafter's copy of a target lm_head; a tied head's is the embedding's anyway)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rows_hint: int,
                 keep_weight: bool = False) -> None:
        super().__init__()
        w = weight.detach().to(dtype).contiguous()
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        # rows_hint: the typical number of input rows, which oneDNN uses to pick the blocked layout (any row count
        # works)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        if keep_weight:
            self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Module, dtype: torch.dtype, rows_hint: int, keep_weight: bool = False
                    ) -> "PackedLinear":
        return cls(linear.weight, linear.bias, dtype, rows_hint, keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}")


def pack_linears(module: nn.Module, dtype: torch.dtype, rows_hint: int, keep_weight: tuple[str, ...] = ()) -> None:
    """Replace every module under `module` whose type is exactly nn.Linear, in place, by a PackedLinear in `dtype`.
    keep_weight: names (e.g. "lm_head") whose `.weight` stays readable."""
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear.from_linear(child, dtype, rows_hint, name in keep_weight))
        else:
            pack_linears(child, dtype, rows_hint, keep_weight)


def pack_target(model: nn.Module) -> None:
    """CPU inference, once at load: every linear of a target model packed for oneDNN in the model's own dtype, so the
    numbers stay the target's precision (only the summation order of its GEMMs changes). Not undone. The original
    weights are freed, except the lm_head's, which the drafter reads: a tied head's is the embedding anyway, an
    untied head's stays next to its packed copy."""
    dtype = next(model.parameters()).dtype
    pack_linears(model, dtype, TARGET_ROWS_HINT, keep_weight=("lm_head",))
