"""The attention prologue as one Triton kernel (GPU): split the packed qkv projection into per-head q, k, v, apply
the optional per-head q/k RMSNorm (Qwen3) and rotary to q and k, and write all three contiguous. Unfused this is a
strided copy per tensor, two norms and two rotary launches per layer; at batch 1 those launches cost more than
their bytes. Same roundings as the unfused path (layers/norm.py, layers/triton_rotary.py): norm statistics in
fp32, cast, weight multiply, cast; rotary rounds after each multiply and after the add.

Given the layer's paged caches and slot_mapping, k and v go straight into the pool (slot -1 skips) instead of into
contiguous tensors, which saves the KV-store launch of every target layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qkv_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, stride, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                PAGED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # heads: HQ of q, then HKV of k, then HKV of v
    D: tl.constexpr = 2 * HALF
    offs = tl.arange(0, BLOCK)
    m = offs < HALF
    src = qkv_ptr + t * stride + h * D
    x1 = tl.load(src + offs, mask=m, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=m, other=0.0)
    ty = x1.dtype
    row = t  # the k/v row written: the token's own (contiguous outputs) or its pool slot (PAGED)
    if PAGED:
        row = tl.load(slot_ptr + t).to(tl.int64)
        if h >= HQ:
            m = m & ((offs * 0 + row) >= 0)  # slot -1: padding / rejected rows are not written
    if h >= HQ + HKV:  # v: a plain copy
        dst = v_ptr + (row * HKV + h - HQ - HKV) * D
        tl.store(dst + offs, x1, mask=m)
        tl.store(dst + HALF + offs, x2, mask=m)
    else:
        if h < HQ:
            w_ptr = qw_ptr
            dst = q_ptr + (t * HQ + h) * D
        else:
            w_ptr = kw_ptr
            dst = k_ptr + (row * HKV + h - HQ) * D
        if NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / D + eps)
            w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
            x1 = (w1 * (f1 * rstd).to(ty).to(tl.float32)).to(ty)
            x2 = (w2 * (f2 * rstd).to(ty).to(tl.float32)).to(ty)
        c = tl.load(cos_ptr + t * D + offs, mask=m, other=0.0).to(tl.float32)  # cos/sin halves are equal
        s = tl.load(sin_ptr + t * D + offs, mask=m, other=0.0).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((a1 * c).to(ty).to(tl.float32) + (-a2 * s).to(ty).to(tl.float32)).to(ty)
        o2 = ((a2 * c).to(ty).to(tl.float32) + (a1 * s).to(ty).to(tl.float32)).to(ty)
        tl.store(dst + offs, o1, mask=m)
        tl.store(dst + HALF + offs, o2, mask=m)


def split_qkv_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                        cos: torch.Tensor, sin: torch.Tensor,
                        paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """qkv [T, (Hq + 2 Hkv) * D] (row stride may exceed the width), norm weights [D] or None, cos/sin [T, 1, D]
    -> q [T, Hq, D], k [T, Hkv, D] (normed, rotated), v [T, Hkv, D], all contiguous. With paged = (k_cache,
    v_cache [num_slots, Hkv, D], slot_mapping [T]), k and v are written into the caches instead (k, v returned as
    None)."""
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if paged is None:
        k = torch.empty(T, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        k_out, v_out, slots = k, v, q  # slots unused
    else:
        k = v = None
        k_out, v_out, slots = paged
    if T:
        norm = q_norm is not None
        _qkv_kernel[(T, num_heads + 2 * num_kv_heads)](
            qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos.contiguous(), sin.contiguous(), q, k_out,
            v_out, slots, qkv.stride(0), eps, HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2,
            BLOCK=triton.next_power_of_2(head_dim // 2), NORM=norm, PAGED=paged is not None)
    return q, k, v
