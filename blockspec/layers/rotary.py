"""Rotary position embedding (neox / rotate-half layout) with default, linear, llama3, yarn and proportional (Gemma 4)
scaling.

The inverse-frequency formulas follow the published definitions of each scaling scheme so that our cos/sin equal
those of the checkpoints' reference implementation bit for bit in fp32."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.layers import kernels


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = int(s.get("original_max_position_embeddings") or max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(float(s.get("beta_fast") or 32)), corr_dim(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn_factor)


def compute_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling applied to cos/sin)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_pos)
    if kind == "proportional":  # Gemma 4's global layers: the first partial_rotary_factor of the pairs rotate
        rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        # the other pairs get frequency 0: cos 1, sin 0, so they pass through unrotated, exactly
        inv = torch.cat([inv[:rotated], torch.zeros(head_dim // 2 - rotated, device="cpu")])
        return inv / float(scaling.get("factor", 1.0)), 1.0
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn, "
                         f"proportional)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int) -> None:
        super().__init__()
        # A plain fp32 attribute, not a buffer: meta-device construction, to_empty() and .to(bf16) leave it intact.
        self.inv_freq, self.attention_scaling = compute_inv_freq(head_dim, theta, scaling, max_pos)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim] (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        # the fewest torch calls (a CPU decode step makes three of these): outer is the broadcast product, and a
        # scaling of 1 or a cast to the dtype it has would change no value
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]."""
    if kernels.fused(x):
        from blockspec.layers.triton_rotary import rotary_

        return rotary_(x.contiguous(), cos, sin)  # contiguous() copies views, so the caller's tensor is untouched
    return x * cos + rotate_half(x) * sin


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with only its first cos.shape[-1] dims rotated, the rest passed through (partial rotary:
    Qwen3.5's partial_rotary_factor; cos / sin from a RotaryEmbedding built over that many dims)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
