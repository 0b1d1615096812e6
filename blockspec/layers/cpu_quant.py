"""Linears on packed int4 / int8 weights for the CPU (--cpu-quant): the weights stay quantized in memory and are
dequantized inside torch's CPU kernels, so a decode step reads 4-8x fewer weight bytes than the fp32 packed path.

- q4 (Int4Linear): asymmetric int4 in groups of 32 along the input dim, w = (q - 8) * scale + zero, scale and zero
  in bf16 (aten._weight_int4pack_mm_for_cpu). A Q4_0 / Q4_1 GGUF's codes come back as they are (its groups span
  the codes 0..15, so re-quantizing the dequantized weights finds them again); only the scales round to bf16.
- q8 (Int8Linear): symmetric int8 per output row, w = q * scale, scale in bf16 (aten._weight_int8pack_mm).

Both kernels are vectorized (AVX2 / AVX512 / NEON) for bf16 activations only, so inputs are cast to bf16 and each
output to the input's dtype: an fp32 target keeps its fp32 residual stream, norms and attention. Each output row is
computed by the same instructions in the same order whatever the other rows are (row blocks of 4, one k-loop per
row; tests/test_cpu_quant.py checks it per kernel), so these linears round a verify step's rows as plain decoding
rounds them. Greedy speculative output equals plain decoding of the quantized model when the rest of the step is
row-invariant too: the bf16 casts turn any 1-ulp difference upstream (the CPU attention has them) into a bf16 one
that can flip a near-tie (docs/results/2026-12-05-cpu-quant-llama-cpp.md). Inference only, like layers/cpu_packed.py."""

from __future__ import annotations

import functools
import platform

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.native import q4

MODES = ("auto", "q8", "q4", "off")
GROUP = 32  # int4 group along the input dim: a GGUF Q4_0 / Q4_1 block
_KERNEL = {"q4": "int4 weights in groups of 32, bf16 activations (aten._weight_int4pack_mm_for_cpu)",
           "q8": "int8 weights per row, bf16 activations (aten._weight_int8pack_mm)"}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"cpu_quant={mode!r} (--cpu-quant) is not one of {', '.join(MODES)}", field="cpu_quant")
    return mode


def kernel_name(mode: str) -> str:
    """What runs the linears in `mode` (for reports): the format and the kernel."""
    if mode in _KERNEL and q4.library() is not None:
        weights = "int4 in blocks of 32" if mode == "q4" else "int8 per row"
        return f"{weights} x int8 activations per block of 32 (blockspec/native, integer dot products)"
    return _KERNEL.get(mode, "the linears as loaded (no weight quantization)")


def supported(mode: str, device: torch.device) -> bool:
    """Whether `device` runs `mode`'s kernel vectorized: a CPU with AVX2 / AVX512 or an ARM one (elsewhere torch
    runs a scalar loop, slower than the fp32 path), in a torch build whose op gives the right numbers."""
    if device.type != "cpu" or mode not in _KERNEL:
        return False
    if q4.library() is not None:
        return True  # blockspec's own kernels (NativeQ4Linear, NativeQ8Linear) built here
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    return vector and _works(mode)


def resolve(mode: str, device: torch.device) -> str:
    """auto -> the fastest mode this device supports (q4, else q8, else off:
    docs/results/2026-12-05-cpu-quant-llama-cpp.md); others as given."""
    if check_mode(mode) != "auto":
        return mode
    return next((m for m in ("q4", "q8") if supported(m, device)), "off")


@functools.lru_cache(maxsize=None)
def _works(mode: str) -> bool:
    """The ops are private: builds that lack them, or compute them wrongly, must fall back rather than fail."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 2 * GROUP, generator=g)
        x = torch.randn(3, 2 * GROUP, generator=g)
        ref = x.bfloat16().float() @ reference_weight(mode, w).T
        torch_kernel = (Int4Linear if mode == "q4" else Int8Linear)(w, None, False)
        return bool(torch.allclose(torch_kernel(x), ref, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, scale and zero bf16 [N, K / GROUP]), per group of GROUP
    inputs: w ~ (code - 8) * scale + zero, the group's min at code 0 and its max at 15. The kernel reads scale and
    zero as bf16, so the codes are chosen against the rounded values."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    # a constant group c: scale |c| / 8 puts it at code 0 with a zero of c + |c| (1 for an all-zero group)
    flat = torch.where(lo != 0, lo.abs() / 8, torch.ones_like(lo))
    scale = torch.where(hi > lo, (hi - lo) / 15, flat).bfloat16()
    zero = (lo + 8 * scale.float()).bfloat16()
    codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    return codes.to(torch.uint8).view(N, K), scale, zero


def int8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes int8 [N, K], scale bf16 [N]): w ~ code * scale, the row's largest |w| at 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(-1) / 127).bfloat16()
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale.float()[:, None]).clamp_(-128, 127).to(torch.int8), scale


def q4_1_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in 0..15, d and m fp16 [N, K / GROUP]): a GGUF Q4_1 block per group of
    GROUP inputs, w ~ d * code + m with the group's min at code 0 and its max at 15. A Q4_1 file's dequantized
    weights come back on their own codes, d and m (its groups span the codes 0..15); the native kernel's format."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half()
    d = torch.where(d.float() > 0, d, torch.ones_like(d))  # a constant group: every code 0
    m = lo.half()
    codes = torch.round((w - m.float()[..., None]) / d.float()[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).view(N, K), d, m


def q8_0_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes int8 [N, K] in -127..127, d fp16 [N, K / GROUP]): a GGUF Q8_0 block per group of
    GROUP inputs, w ~ d * code with the group's largest |w| at 127. A Q8_0 file's dequantized tensors come back on
    their own codes and d; the native kernel's format."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    d = (w.abs().amax(-1) / 127).half()
    d = torch.where(d.float() > 0, d, torch.ones_like(d))
    codes = torch.round(w / d.float()[..., None]).clamp_(-127, 127)
    return codes.to(torch.int8).view(N, K), d


def reference_weight(mode: str, weight: torch.Tensor, native: bool = False) -> torch.Tensor:
    """The fp32 weight [N, K] that `mode`'s kernel computes with for `weight`: the dequantized reference (native:
    of blockspec's own kernels, NativeQ4Linear / NativeQ8Linear, else of torch's)."""
    N, K = weight.shape
    if native and mode == "q8":
        codes, d = q8_0_quantize(weight)
        return (codes.float().view(N, K // GROUP, GROUP) * d.float()[..., None]).view(N, K)
    if native:
        codes, d, m = q4_1_quantize(weight)
        return (codes.float().view(N, K // GROUP, GROUP) * d.float()[..., None] + m.float()[..., None]).view(N, K)
    if mode == "q8":
        codes, scale = int8_quantize(weight)
        return codes.float() * scale.float()[:, None]
    codes, scale, zero = int4_quantize(weight)
    q = codes.float().view(N, K // GROUP, GROUP) - 8
    return (q * scale.float()[..., None] + zero.float()[..., None]).view(N, K)


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W = reference_weight(mode, weight), x rounded to bf16 and y to bf16, then cast to x's
    dtype; x [..., in] of any float dtype. keep_weight: `.weight` stays the original parameter (for the drafter's
    reads of a target lm_head, as PackedLinear's)."""

    mode = ""  # the --cpu-quant mode this kernel runs

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float()
        if keep_weight:
            self.weight = weight

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] bf16 contiguous -> [M, out] bf16."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        # a fresh (aligned) copy, for bf16 inputs too: the kernels load rows aligned, and _weight_int8pack_mm
        # crashes on a view at an odd offset
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16, copy=x.dtype == torch.bfloat16)
        y = self.matmul(rows).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(QuantLinear):
    mode = "q4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> None:
        super().__init__(weight, bias, keep_weight)
        codes, scale, zero = int4_quantize(weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [K / GROUP, N, 2]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_zero)


class NativeQ4Linear(QuantLinear):
    """q4 on blockspec's own kernel (blockspec/native/q4gemm.c), where it builds: GGUF Q4_1 blocks (a Q4_1 file's
    own codes, d and m in fp16), fp32 activations quantized per row and block of 32 to int8 (llama.cpp's Q8_1) and
    integer dot products; fp32 out. Rows are computed alone and the same on every path (the kernel's comment)."""

    mode = "q4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> None:
        super().__init__(weight, bias, keep_weight)
        self.weights = q4.Q4Weights(*q4_1_quantize(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.weights.matmul(x.reshape(-1, self.in_features).float()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)


class NativeQ8Linear(QuantLinear):
    """q8 on blockspec's own kernel (blockspec/native/q8gemm.c), where it builds: GGUF Q8_0 blocks (a Q8_0 file's
    own codes and fp16 scales), fp32 activations quantized per row and block of 32 to int8, integer dot products;
    fp32 out. Used for the q4 target's head and the drafter's reads of it, where torch's int8 kernel costs nearly a
    full pass per row."""

    mode = "q8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> None:
        super().__init__(weight, bias, keep_weight)
        self.weights = q4.Q8Weights(*q8_0_quantize(weight))

    forward = NativeQ4Linear.forward

    def rows(self, n: int) -> "NativeQ8Linear":
        """The first n output rows (a multiple of 8), sharing this linear's packed weights (the drafter's vocabulary
        prefix of a q4 target's head: its codes are the head's, and one copy stays in memory and cache)."""
        out = object.__new__(NativeQ8Linear)
        nn.Module.__init__(out)
        out.out_features, out.in_features, out.bias = n, self.in_features, None
        out.weights = self.weights.rows(n)
        return out


class Int8Linear(QuantLinear):
    mode = "q8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> None:
        super().__init__(weight, bias, keep_weight)
        self.codes, self.scale = int8_quantize(weight)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)


def fits(mode: str, weight: torch.Tensor) -> bool:
    """Whether the kernel of `mode` takes a weight of this shape (int4: in a multiple of 32, out of 16; int8: in a
    multiple of 16, which its vector loop steps by)."""
    out_f, in_f = weight.shape
    return in_f % GROUP == 0 and out_f % 16 == 0 if mode == "q4" else in_f % 16 == 0


def quantize(mode: str, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False) -> QuantLinear:
    """blockspec's kernels where they are built (fits() keeps outputs a multiple of 16; q8 needs inputs of whole
    blocks of 32 there), else torch's."""
    native = q4.library() is not None
    if mode == "q4":
        return (NativeQ4Linear if native else Int4Linear)(weight, bias, keep_weight)
    use = native and weight.shape[1] % GROUP == 0
    return (NativeQ8Linear if use else Int8Linear)(weight, bias, keep_weight)


@torch.no_grad()
def quantize_linears(module: nn.Module, mode: str, skip: tuple[str, ...] = ()) -> None:
    """Replace every nn.Linear (exactly) under `module` whose shape the kernel takes by its QuantLinear, in place;
    the others, and children named in `skip`, stay."""
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if type(child) is nn.Linear:
            if fits(mode, child.weight):
                setattr(module, name, quantize(mode, child.weight, child.bias))
        else:
            quantize_linears(child, mode, skip)


@torch.no_grad()
def quantize_target(model: nn.Module, mode: str) -> None:
    """A target's linears in `mode`, its lm_head in int8 wherever q8 runs: an int4 head costs 5 points of top-1
    agreement with the fp32 model on the demo prompts (93.1 % vs 98.1 %) for ~1 ms a step
    (docs/results/2026-12-05-cpu-quant-llama-cpp.md). The head
    keeps its `.weight` (the drafter reads it; a tied head's is the embedding's anyway)."""
    quantize_linears(model, mode, skip=("lm_head",))
    head = model.lm_head
    head_mode = "q8" if supported("q8", head.weight.device) else mode
    if type(head) is nn.Linear and fits(head_mode, head.weight):
        model.lm_head = quantize(head_mode, head.weight, head.bias, keep_weight=True)
