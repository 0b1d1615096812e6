"""The weights and activations as the native Q4 x Q8 and Q8 x Q8 kernels (q4gemm.c, q8gemm.c) read them, and their
matmuls: what layers/cpu_quant.py's NativeQ4Linear and NativeQ8Linear run. Written here because torch's CPU int4
kernels dequantize to fp32 FMAs (each further 4-row block costs another pass) and take bf16 activations: these take
int8 activations with integer dot products and stream the weights once for all rows (docs/decisions/native-c.md).

`library()` (lib.py) is None where the kernels cannot be built (build.py says why, once) or BLOCKSPEC_NATIVE=0: then
--cpu-quant keeps torch's kernels and nothing here is constructed."""

from __future__ import annotations

import torch

from blockspec.native.lib import best_path, library

__all__ = ["QK", "Q4Weights", "Q8Weights", "best_path", "library", "quantize_rows"]
QK = 32  # inputs per block (native.h's QK)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class Q4Weights:
    """A weight [N, K] as the kernel reads it, from GGUF Q4_1 blocks: codes [N, K] (0..15) and per-block d, m
    [N, K / 32] (fp16), w = d * code + m. N a multiple of 8, K of 32."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        N, K = codes.shape
        self.N, self.K, self.KB = N, K, K // QK
        codes = codes.to(torch.uint8).contiguous()
        self.packed = torch.empty(N * K // 2, dtype=torch.uint8)
        library().q4_pack(_ptr(codes), N, K, _ptr(self.packed))
        self.d, self.m = (_by_group(v, N, self.KB) for v in (d, m))

    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.d.numel() + 2 * self.m.numel()

    def matmul(self, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 (activations quantized per row and block of 32 to int8 inside)."""
        M = x.shape[0]
        qx, sx, xs = quantize_rows(x, self.KB)
        y = torch.empty(M, self.N)
        library().q4_gemm(_ptr(self.packed), _ptr(self.d), _ptr(self.m), self.N, self.K, _ptr(qx), _ptr(sx), _ptr(xs),
                          M, _ptr(y), torch.get_num_threads(), best_path() if path is None else path)
        return y


def _by_group(v: torch.Tensor, N: int, KB: int) -> torch.Tensor:
    """per-block fp16 values [N, KB] -> [N / 8, KB, 8]: a block's 8 outputs of a group load as one vector."""
    return v.to(torch.float16).view(N // 8, 8, KB).transpose(1, 2).contiguous()


def quantize_rows(x: torch.Tensor, KB: int) -> tuple[torch.Tensor, ...]:
    """x [M, K] fp32 -> (codes int8 [M, K], sx, xs [M, KB]): q4gemm.c's int8 activations."""
    M, K = x.shape
    x = x.contiguous()
    qx = torch.empty(M, K, dtype=torch.int8)
    sx, xs = torch.empty(M, KB), torch.empty(M, KB)
    library().q8_quantize_rows(_ptr(x), M, K, _ptr(qx), _ptr(sx), _ptr(xs))
    return qx, sx, xs


class Q8Weights:
    """A weight [N, K] as q8gemm.c reads it, from GGUF Q8_0 blocks: int8 codes [N, K] and per-block d [N, K / 32]
    (fp16), w = d * code. N a multiple of 8, K of 32."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        N, K = codes.shape
        self.N, self.K, self.KB = N, K, K // QK
        self.packed = torch.empty(N * K, dtype=torch.int8)
        library().q8w_pack(_ptr(codes.to(torch.int8).contiguous()), N, K, _ptr(self.packed))
        self.d = _by_group(d, N, self.KB)

    def rows(self, n: int) -> "Q8Weights":
        """The first n outputs (a multiple of 8) as weights of their own: views of these (groups are stored one after
        another), no copy."""
        out = object.__new__(Q8Weights)
        out.N, out.K, out.KB = n, self.K, self.KB
        out.packed, out.d = self.packed[:n * self.K], self.d[:n // 8]
        return out

    def matmul(self, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 (activations quantized per row and block of 32 to int8 inside)."""
        M = x.shape[0]
        qx, sx, _ = quantize_rows(x, self.KB)
        y = torch.empty(M, self.N)
        library().q8_gemm(_ptr(self.packed), _ptr(self.d), self.N, self.K, _ptr(qx), _ptr(sx), M, _ptr(y),
                          torch.get_num_threads(), best_path() if path is None else path)
        return y
