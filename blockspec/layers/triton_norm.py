"""RMSNorm (optionally fused with the residual add before it) and SiLU-and-multiply as single Triton kernels (GPU):
the torch versions launch several small kernels per call, which at batch 1 cost more than their memory traffic.
The torch code's formula and rounding points: the residual sum rounded to the input dtype, fp32 statistics, cast to
the input dtype, then the weight multiply; silu rounded to the input dtype before the multiply. (The reciprocal
square root is the GPU's fast one, so a normed value can differ from torch by an ulp.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(o_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(o_ptr + row * N + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> same shape and dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, x2.shape[1], eps, BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(shape)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, h_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * N + offs, h, mask=m)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    y = (hf * rstd).to(o_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(o_ptr + row * N + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x) for x, residual [T, N]."""
    x2, r2 = x.contiguous(), residual.contiguous()
    out, h = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _add_rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, out, h, x2.shape[1], eps,
                                            BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out, h


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(x_ptr + row * 2 * N + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N + N + offs, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * N + offs, (s * u).to(o_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    x = gate_up.contiguous()
    T, N = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(N, 1024))](x, out, N, BLOCK=1024)
    return out
