"""Batch-invariant linear layers: a Triton GEMM whose every output row is computed by the same instructions in the
same order whatever the number of rows M, so a token's activations do not depend on what it is batched with.

Why: cuBLAS picks its algorithm (tile shape, split-K) from M. A verify forward (K + 1 rows per request) and a plain
decode forward (1 row per request) then round differently, and in bf16 a near-tie between two tokens can flip, so
speculative output drifts from plain decoding. With this GEMM, the paged attention's deterministic mode and the
row-wise Triton norms, every target row is bitwise the same however it is batched: bf16 speculative decoding is then
lossless token for token, not just in distribution. The cost is a fixed tile shape (no per-shape tuning, no split-K).

Fixed: the tile (BLOCK_M x BLOCK_N x BLOCK_K), warps and stages; the K loop runs from 0 up in BLOCK_K steps; M is
not specialized on, so one compiled kernel serves every M. Rows beyond M are loaded as zeros and never stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from blockspec.layers import kernels


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int

    @classmethod
    def parse(cls, text: str) -> "Tile":
        """"64,64,64,4,3" -> Tile(64, 64, 64, 4, 3)."""
        return cls(*(int(v) for v in text.split(",")))


# One tile for every GEMM: rows computed under different tiles round differently. The fastest of eight on the H200
# (python -m benchmarks.invariant_gemm, docs/results/2026-12-04-h200-batch-invariant-cost.md).
TILE = Tile(64, 64, 64, 4, 3)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # axis 0 walks M fastest, so the programs resident together share one weight tile through L2
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PREC).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     tile: Tile | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation (tile: TILE)."""
    t = tile or TILE
    lead, K = x.shape[:-1], x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, t.block_m), triton.cdiv(N, t.block_n))
        _gemm_kernel[grid](x2, weight.contiguous(), bias if bias is not None else weight, y, M, N, K,
                           HAS_BIAS=bias is not None,
                           # fp32 stays exact (no TF32 rounding), as in the rest of the fp32 oracle path
                           PREC="ieee" if x.dtype == torch.float32 else "tf32",
                           BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps,
                           num_stages=t.stages)
    return y.view(*lead, N)


class InvariantLinear(nn.Module):
    """An nn.Linear's parameters (the same Parameter objects: a head tied to the embedding stays tied) behind the
    batch-invariant GEMM. Inference only: the Triton kernel has no backward."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused(x):
            return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def make_batch_invariant(model: nn.Module) -> None:
    """Replace, in place, every module under `model` whose type is exactly nn.Linear by an InvariantLinear."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, InvariantLinear(child))
        else:
            make_batch_invariant(child)
