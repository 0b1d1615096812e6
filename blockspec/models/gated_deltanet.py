"""One Gated DeltaNet layer (HF's `linear_attn` of Qwen3.5 / Qwen3.6): projections, short causal conv over q|k|v,
the gated delta rule (layers/gated_delta.py) over each sequence's state slot (models/hybrid_state.py), gated RMSNorm,
output projection. Parameter names are the checkpoint's, with in_proj_qkv | in_proj_z | in_proj_b | in_proj_a packed
into one `in_proj` at load (one GEMM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.gated_delta import chunked_rule, l2_normalize, recurrent_rule
from blockspec.layers.gated_norm import GatedRMSNorm
from blockspec.layers.short_conv import ShortConv
from blockspec.models.hybrid_state import RecurrentBatch, RecurrentShape, SeqGroup


@dataclass(frozen=True)
class LinearAttnDims:
    """A linear-attention layer's sizes (config.json's linear_* fields)."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each key head serves num_v_heads / num_k_heads value heads
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:  # q | k | v go through the conv
        return 2 * self.key_size + self.value_size

    def in_proj_sizes(self) -> list[int]:
        """Rows of the packed in_proj: q|k|v (conv input), z (output gate), b (beta), a (decay)."""
        return [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads]

    def state_shape(self, num_layers: int) -> RecurrentShape:
        return RecurrentShape(num_layers, self.conv_dim, self.conv_kernel, self.num_v_heads, self.k_dim, self.v_dim)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, dims: LinearAttnDims, eps: float, state_index: int) -> None:
        super().__init__()
        self.dims, self.state_index = dims, state_index  # state_index: this layer's place in the RecurrentState
        self.in_proj = nn.Linear(hidden_size, sum(dims.in_proj_sizes()), bias=False)
        self.conv1d = ShortConv(dims.conv_dim, dims.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(dims.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(dims.num_v_heads))  # decay rate per value head: -exp(A_log) < 0
        self.norm = GatedRMSNorm(dims.v_dim, eps)
        self.out_proj = nn.Linear(dims.value_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: RecurrentBatch) -> torch.Tensor:
        """x [T, hidden] (the batch's rows, sequence after sequence) -> [T, hidden]; each sequence's state read from
        and written back to its slot (or, keep_rows, to the per-row scratch)."""
        d, T = self.dims, x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(d.in_proj_sizes(), dim=-1)
        beta = b.sigmoid().float()  # [T, Hv] write strength
        # log decay per row and value head, <= 0; in fp32 (exp of A_log in half precision can overflow)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = x.new_empty(T, d.num_v_heads, d.v_dim)
        for group in state.groups:
            core[group.rows] = self._group(mixed, g, beta, state, group).to(core.dtype)
        out = self.norm(core, z.reshape(T, d.num_v_heads, d.v_dim))
        return self.out_proj(out.reshape(T, d.value_size))

    def _group(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: RecurrentBatch,
               group: SeqGroup) -> torch.Tensor:
        """The delta-rule output [b, L, Hv, Dv] of one group of sequences, their state stored."""
        d, rows = self.dims, group.rows
        B, L = rows.shape
        window, ssm = state.initial(self.state_index, group)
        conv, kept = self.conv1d(mixed[rows], window, keep_rows=group.keep)  # [B, L, conv_dim]
        q, k, v = conv.float().split([d.key_size, d.key_size, d.value_size], dim=-1)
        q = l2_normalize(q.reshape(B, L, d.num_k_heads, d.k_dim))
        k = l2_normalize(k.reshape(B, L, d.num_k_heads, d.k_dim))
        if d.num_v_heads != d.num_k_heads:  # value heads h * r .. h * r + r - 1 read key head h
            r = d.num_v_heads // d.num_k_heads
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        q = q * d.k_dim ** -0.5
        v = v.reshape(B, L, d.num_v_heads, d.v_dim)
        if group.recurrent:
            out, final, per_row = recurrent_rule(q, k, v, g[rows], beta[rows], ssm, keep_rows=group.keep)
        else:
            out, final = chunked_rule(q, k, v, g[rows], beta[rows], ssm)
            per_row = None
        state.store(self.state_index, group, kept, per_row if group.keep else final)  # type: ignore[arg-type]
        return out
