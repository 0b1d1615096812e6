"""The DFlash block-diffusion draft model (z-lab checkpoint format, loaded as-is).

A Qwen3-style stack whose attention takes Q from the block only and K/V from [context ; block]. Context features
(the target's tapped residual streams) go through fc -> hidden_norm once, then each layer's own k_proj/v_proj; those
context K/V depend only on committed tokens, so they are computed once per token and cached. Block K/V live for one
pass. The draft has no embedding or lm_head: the target's are passed in."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers import kernels
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, apply_rotary
from blockspec.models.dflash_config import DFlashConfig
from blockspec.models.llama import MLP


PagedDest = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k_cache, v_cache [num_slots, Hkv, D], slot_mapping [N])


class DraftAttentionFn(Protocol):
    """Attention of block queries over the cached context of this draft layer plus the block's own k/v."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
        window: int | None,
    ) -> torch.Tensor: ...


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.causal = cfg.layer_causal[layer_idx]
        self.window = cfg.layer_window[layer_idx]
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D, H] once fuse_qkv() ran (inference, GPU)

    def fuse_qkv(self) -> None:
        """Inference on GPU: q/k/v weights become views of one packed matrix, so the block's projection is one GEMM
        and its split + q/k norm + rotary one Triton kernel (as the target's layers). The checkpoint names stay."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv_weight is not None or any(type(p) is not nn.Linear or p.bias is not None for p in projs):
            return  # already fused, or tensor-parallel shards / biases: the unfused path serves those
        w = torch.cat([p.weight.detach() for p in projs])
        sizes = [p.weight.shape[0] for p in projs]
        for p, part in zip(projs, w.split(sizes)):
            p.weight = nn.Parameter(part, requires_grad=False)
        self.qkv_weight = w

    def _fused(self, x: torch.Tensor) -> bool:
        return (self.qkv_weight is not None and kernels.fused(x)
                and x.dtype == self.qkv_weight.dtype == self.q_norm.weight.dtype)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged: PagedDest | None = None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [N, H] -> k, v [N, Hkv, D] (k normed and rotated; v untouched). The fused path writes them into
        paged = (k_cache, v_cache, slot_mapping) when given, and returns (None, None)."""
        N = x.shape[0]
        if self._fused(x):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            kv = F.linear(x, self.qkv_weight[self.num_heads * self.head_dim:])  # the k and v rows: no q heads
            _, k, v = split_qkv_norm_rope(kv, 0, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                                          self.k_norm.weight, self.k_norm.eps, cos, sin, paged)
            return k, v
        k = self.k_norm(self.k_proj(x).view(N, self.num_kv_heads, self.head_dim))
        return apply_rotary(k, cos, sin), self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DraftAttentionFn) -> torch.Tensor:
        T = x.shape[0]
        if self._fused(x):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            q, k, v = split_qkv_norm_rope(F.linear(x, self.qkv_weight), self.num_heads, self.num_kv_heads,
                                          self.head_dim, self.q_norm.weight, self.k_norm.weight, self.k_norm.eps,
                                          cos, sin)
        else:
            q = apply_rotary(self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim)), cos, sin)
            k, v = self.kv(x, cos, sin)
        out = attn(self.layer_idx, q, k, v, self.scale, self.causal, self.window)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # type: ignore[arg-type]  (needs hidden_size / intermediate_size only)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: DraftAttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's output delta (None before layer 0) -> (h, this layer's
        output); each residual add is fused with the norm that follows it (one kernel on GPU, same sums)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, attn), h)
        return h, self.mlp(x)


class DFlashDraftModel(nn.Module):
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: DFlashConfig, num_taps: int) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def shard_sizes(self, param: str) -> list[int]:
        return [self.config.intermediate_size, self.config.intermediate_size]

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor, paged: Callable[[int], PagedDest] | None = None
                   ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """taps [N, num_taps*H] of committed tokens at `positions` [N] -> per draft layer (k, v) [N, Hkv, D].
        paged(layer) -> (k_cache, v_cache, slot_mapping): where the fused GPU path may write them itself (a
        layer's (k, v) is (None, None) then; the caller stores the others)."""
        ctx = self.hidden_norm(self.fc(taps))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin, paged(i) if paged is not None else None)
                for i, layer in enumerate(self.layers)]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn: DraftAttentionFn) -> torch.Tensor:
        """embeds [T, H] (raw target embeddings of the block; scaled here), positions [T] -> final-normed [T, H]."""
        h = embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, attn)
        return self.norm.add_forward(delta, h)[0]

    def fuse_qkv(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse_qkv()

    def greedy_drafts(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """argmax of compute_logits; without multiplier or softcap the fp32 copy of [rows, vocab] logits cannot change
        the argmax (the cast is exact), so it is skipped."""
        if self.config.output_multiplier == 1.0 and not self.config.final_logit_softcapping:
            return lm_head(hidden).argmax(-1)
        return self.compute_logits(hidden, lm_head).argmax(-1)

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
