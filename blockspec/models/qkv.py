"""An attention layer's q|k|v projection as one module, with the prologue after it (per-head q/k RMSNorm, rotary), in
the variants a platform picks once at load (loading/prepare.py). The DFlash drafter's layers use it; the checkpoint's
q_proj / k_proj / v_proj are packed into its one weight at load, as the target's qkv_proj is.

- LinearQKV: the weight as a parameter (reference, training, tensor-parallel shards). Off the fused path (CPU,
  autograd) q, k and v are three GEMMs over its row blocks: the numbers and gradients of three separate linears,
  which training and the fp32 exactness tests rely on. On CUDA without autograd it is one GEMM and one Triton kernel
  (split, q/k norm, rotary; context k/v written straight into the paged pool), as in the target's layers.
- PackedQKV: CPU inference, the rows packed once for oneDNN (layers/cpu_packed.py): one GEMM, then one norm and one
  rotary over the q and k heads together.
- ContextKV / PackedContextKV: k/v of committed context rows for a stack of layers: layer by layer, or (CPU packed)
  every layer's k|v rows in one GEMM."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers import kernels
from blockspec.layers.cpu_packed import PackedLinear
from blockspec.layers.norm import RMSNorm, rms_norm
from blockspec.layers.rotary import apply_rotary
from blockspec.models.base import PagedDest

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
KV = tuple[torch.Tensor | None, torch.Tensor | None]


class QKVProjection(nn.Module):
    """x [T, in] -> q [T, Hq, D], k and v [T, Hkv, D]; q and k normed per head and rotated, v as projected."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @property
    def sizes(self) -> list[int]:
        """Rows of q, k and v in the packed weight."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [q, kv, kv]

    def forward(self, x: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor
                ) -> QKV:
        raise NotImplementedError


class LinearQKV(QKVProjection):
    def __init__(self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.in_features = in_features
        rows = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(rows, in_features))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialization of q, then k, then v (the draws of three separate nn.Linear)."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        for w, b in self._parts():
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def _parts(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of q, k and v: views of the packed rows."""
        bias = self.bias.split(self.sizes) if self.bias is not None else (None, None, None)
        return list(zip(self.weight.split(self.sizes), bias))

    def kv_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the k rows followed by the v rows."""
        q = self.sizes[0]
        return self.weight[q:], None if self.bias is None else self.bias[q:]

    def _fused(self, x: torch.Tensor, norm: RMSNorm) -> bool:
        return kernels.fused(x) and x.dtype == self.weight.dtype == norm.weight.dtype

    def forward(self, x: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor
                ) -> QKV:
        if self._fused(x, q_norm):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            return split_qkv_norm_rope(F.linear(x, self.weight, self.bias), self.num_heads, self.num_kv_heads,
                                       self.head_dim, q_norm.weight, k_norm.weight, k_norm.eps, cos, sin)
        (wq, bq), k_rows, v_rows = self._parts()
        q = apply_rotary(q_norm(F.linear(x, wq, bq).view(x.shape[0], self.num_heads, self.head_dim)), cos, sin)
        return (q, *self._kv(x, k_norm, cos, sin, k_rows, v_rows))

    def kv(self, x: torch.Tensor, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor,
           paged: PagedDest | None = None) -> KV:
        """x [N, in] -> k, v [N, Hkv, D] only (a drafter's context rows). The fused path writes them into
        paged = (k_cache, v_cache, slot_mapping) when given, and returns (None, None)."""
        if self._fused(x, k_norm):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            _, k, v = split_qkv_norm_rope(F.linear(x, *self.kv_rows()), 0, self.num_kv_heads, self.head_dim,
                                          k_norm.weight, k_norm.weight, k_norm.eps, cos, sin, paged)
            return k, v
        _, k_rows, v_rows = self._parts()
        return self._kv(x, k_norm, cos, sin, k_rows, v_rows)

    def _kv(self, x: torch.Tensor, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor,
            k_rows: tuple[torch.Tensor, torch.Tensor | None], v_rows: tuple[torch.Tensor, torch.Tensor | None]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        N, Hkv, D = x.shape[0], self.num_kv_heads, self.head_dim
        k = apply_rotary(k_norm(F.linear(x, *k_rows).view(N, Hkv, D)), cos, sin)
        return k, F.linear(x, *v_rows).view(N, Hkv, D)


class PackedQKV(QKVProjection):
    """A LinearQKV's rows packed for oneDNN in `dtype` (inference on the CPU; the parameters are not kept)."""

    def __init__(self, proj: LinearQKV, q_norm: RMSNorm, k_norm: RMSNorm, dtype: torch.dtype, rows_hint: int) -> None:
        super().__init__(proj.num_heads, proj.num_kv_heads, proj.head_dim)
        self.linear = PackedLinear(proj.weight, proj.bias, dtype, rows_hint)
        D = self.head_dim
        # q_norm's weight for each q head, then k_norm's for each k head: [Hq + Hkv, D]
        self.qk_norm_weight = torch.cat([q_norm.weight.detach().expand(self.num_heads, D),
                                         k_norm.weight.detach().expand(self.num_kv_heads, D)])

    def forward(self, x: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor
                ) -> QKV:
        """Per head the same arithmetic as q_norm / k_norm and apply_rotary, in fewer eager ops."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.linear(x)
        qk = rms_norm(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), self.qk_norm_weight, q_norm.eps)
        qk = apply_rotary(qk, cos, sin)
        return qk[:, :Hq], qk[:, Hq:], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)


class ContextKV(nn.Module):
    """Context k/v of every layer, each through its own projection (`paged(i)`: where layer i's fused prologue may
    write them itself; that layer's pair is then (None, None) and the caller stores the others)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, projs: Sequence[LinearQKV],
                k_norms: Sequence[RMSNorm], paged: Callable[[int], PagedDest] | None = None) -> list[KV]:
        return [p.kv(x, n, cos, sin, paged(i) if paged is not None else None)
                for i, (p, n) in enumerate(zip(projs, k_norms))]


class PackedContextKV(ContextKV):
    """CPU inference: every layer's context k|v rows in one GEMM packed for oneDNN, one k-norm and one rotary (per
    layer the same arithmetic as LinearQKV.kv). `paged` is for the fused GPU prologue only."""

    def __init__(self, projs: Sequence[LinearQKV], k_norms: Sequence[RMSNorm], dtype: torch.dtype,
                 rows_hint: int) -> None:
        super().__init__()
        kv = [p.kv_rows() for p in projs]  # each layer's k rows, then its v rows
        bias = None if kv[0][1] is None else torch.cat([b for _, b in kv])  # type: ignore[misc]
        self.linear = PackedLinear(torch.cat([w for w, _ in kv]), bias, dtype, rows_hint)
        self.k_norm_weight = torch.stack([n.weight.detach() for n in k_norms])[:, None]  # [L, 1, D]
        self.eps, self.num_kv_heads, self.head_dim = k_norms[0].eps, projs[0].num_kv_heads, projs[0].head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, projs: Sequence[LinearQKV],
                k_norms: Sequence[RMSNorm], paged: Callable[[int], PagedDest] | None = None) -> list[KV]:
        L, N = self.k_norm_weight.shape[0], x.shape[0]
        kv = self.linear(x).view(N, L, 2, self.num_kv_heads, self.head_dim)
        k = apply_rotary(rms_norm(kv[:, :, 0], self.k_norm_weight, self.eps), cos[:, None], sin[:, None])
        return [(k[:, i], kv[:, i, 1]) for i in range(L)]
