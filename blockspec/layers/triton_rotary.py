"""Rotary embedding of q and k as one Triton kernel (GPU), replacing ~12 small torch kernels per layer.

Rounds to the input dtype after each multiply and after the add, exactly where the torch expression
`x * cos + rotate_half(x) * sin` rounds, so bf16 results match it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, H, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) row of x [T*H, 2*HALF], in place
    tok = row // H
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    base = x_ptr + row * 2 * HALF
    x1 = tl.load(base + offs, mask=m, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=m, other=0.0)
    c = tl.load(cos_ptr + tok * 2 * HALF + offs, mask=m, other=0.0)  # cos/sin halves are equal: read the first
    s = tl.load(sin_ptr + tok * 2 * HALF + offs, mask=m, other=0.0)
    ty = x1.dtype
    o1 = ((x1.to(tl.float32) * c.to(tl.float32)).to(ty).to(tl.float32)
          + (-x2.to(tl.float32) * s.to(tl.float32)).to(ty).to(tl.float32)).to(ty)
    o2 = ((x2.to(tl.float32) * c.to(tl.float32)).to(ty).to(tl.float32)
          + (x1.to(tl.float32) * s.to(tl.float32)).to(ty).to(tl.float32)).to(ty)
    tl.store(base + offs, o1, mask=m)
    tl.store(base + HALF + offs, o2, mask=m)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x [T, H, D] contiguous, cos/sin [T, 1, D] (dtype of x). Returns x."""
    T, H, D = x.shape
    if T:
        _rotary_kernel[(T * H,)](x, cos.contiguous(), sin.contiguous(), H, HALF=D // 2,
                                 BLOCK=triton.next_power_of_2(D // 2))
    return x
