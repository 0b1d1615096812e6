"""One Gated DeltaNet layer (HF's `linear_attn` of Qwen3.5 / Qwen3.6): projections, short causal conv over q|k|v,
the gated delta rule (layers/gated_delta.py) over each sequence's state slot (models/hybrid_state.py), gated RMSNorm,
output projection; and `commit`, the replay that rolls a verify block's state back to its accepted rows. Parameter
names are the checkpoint's, with in_proj_qkv | in_proj_z | in_proj_b | in_proj_a packed into one `in_proj` at load
(one GEMM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.gated_delta import gated_delta_rule, l2_normalize
from blockspec.layers.gated_norm import GatedRMSNorm
from blockspec.layers.short_conv import ShortConv, window_after
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
        its slot and written back, but for verify blocks (kept groups), whose slot stays and whose rows' inputs go
        to the replay scratch (commit)."""
        d, T = self.dims, x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(d.in_proj_sizes(), dim=-1)
        beta = b.sigmoid().float()  # [T, Hv] write strength
        # log decay per row and value head, <= 0; in fp32 (exp of A_log in half precision can overflow)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        groups = state.groups
        if len(groups) == 1 and groups[0].rows is None:  # every sequence alike (the decode step): no scatter
            core = self._group(mixed, g, beta, state, groups[0]).reshape(T, d.num_v_heads, d.v_dim).to(x.dtype)
        else:
            core = x.new_empty(T, d.num_v_heads, d.v_dim)
            for group in groups:
                core[group.rows] = self._group(mixed, g, beta, state, group).to(core.dtype)
        out = self.norm(core, z.reshape(T, d.num_v_heads, d.v_dim))
        return self.out_proj(out.reshape(T, d.value_size))

    def _group(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: RecurrentBatch,
               group: SeqGroup) -> torch.Tensor:
        """The delta-rule output [b, L, Hv, Dv] of one group of sequences; their state stored, or for a verify
        group their rows' inputs kept."""
        x, g, beta = group.take(mixed), group.take(g), group.take(beta)
        window, ssm = state.initial(self.state_index, group)
        out, last_window, final = self._rule(x, window, g, beta, ssm, chunked=not group.recurrent, outputs=True)
        if group.keep:
            state.keep_inputs(self.state_index, group, x, g, beta)
        else:
            state.store(self.state_index, group, last_window, final)
        return out  # type: ignore[return-value]

    def _rule(self, x: torch.Tensor, window: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor,
              chunked: bool, outputs: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Conv over x [b, L, C] from window [b, C, K-1], then the delta rule from ssm [b, Hv, Dk, Dv] with g, beta
        [b, L, Hv] -> (out [b, L, Hv, Dv] or None, the window after the last row, the final state)."""
        d = self.dims
        B, L = x.shape[:2]
        conv, last_window = self.conv1d(x, window)  # [b, L, conv_dim]
        q, k, v = conv.float().split([d.key_size, d.key_size, d.value_size], dim=-1)
        q = l2_normalize(q.reshape(B, L, d.num_k_heads, d.k_dim)) * d.k_dim ** -0.5
        k = l2_normalize(k.reshape(B, L, d.num_k_heads, d.k_dim))
        out, final = gated_delta_rule(q, k, v.reshape(B, L, d.num_v_heads, d.v_dim), g, beta, ssm, chunked, outputs)
        return out, last_window, final

    def commit(self, state: RecurrentBatch, accepted: torch.Tensor) -> None:
        """After a forward with verify groups: each verify block's slot <- its state after row accepted[b] ([B]
        int64 drafts accepted, per batch position; other sequences' entries unread). The block is replayed from its
        slot over all its rows, the rows past n neutralized (g = 0: no decay; beta = 0: no write), so the state is
        exactly that after rows 0..n; the conv window is the inputs ending at row n. On the device, no host sync."""
        for group in state.groups:
            if not group.keep:
                continue
            x, g, beta = state.kept_inputs(self.state_index, group)
            n = accepted if group.rows is None else accepted[group.seqs]
            live = (torch.arange(group.length, device=n.device)[None] <= n[:, None])[..., None]  # [b, L, 1]
            window, ssm = state.initial(self.state_index, group)
            _, _, final = self._rule(x, window, torch.where(live, g, 0.0), torch.where(live, beta, 0.0), ssm,
                                     chunked=False, outputs=False)
            state.store(self.state_index, group, window_after(window, x, n), final)
