"""The Qwen3.5 / Qwen3.6 hybrid family, dense (Qwen3_5ForCausalLM): per `layer_types`, Gated DeltaNet layers
(models/gated_deltanet.py: linear attention over a per-sequence recurrent state) and gated full-attention layers
(paged K/V as in every family), each followed by the SwiGLU MLP. What differs from the shared decoder:

- norms scale by (1 + weight) (layers/gated_norm.OffsetRMSNorm): the layer norms, the final norm, the q/k norms;
- full attention: q_proj gives per head [q | gate] (2 x head_dim), the output is multiplied by sigmoid(gate) before
  o_proj; per-head q/k norm; rotary over the first partial_rotary_factor x head_dim dims of each head only. The
  checkpoints' multimodal rotary (mrope_section) gives every section the same position for text, i.e. plain RoPE;
- a full-attention layer's K/V lives at its order among the full-attention layers (`num_kv_layers` pool layers), a
  linear layer's state at its order among the linear layers (`recurrent_shape()`);
- forward takes `state`, the batch's RecurrentBatch (models/hybrid_state.py: slots, verify groups and the engine's
  part); after a verify step `commit_state` rolls each verify block's state back to its accepted rows (a replay).

Qwen3_5ForConditionalGeneration checkpoints (config.json's text_config, tensors under model.language_model.) load
their language model; the vision tower and the multi-token-prediction head (mtp.*) are skipped."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.kv.pool import CacheShape
from blockspec.layers.gated_norm import OffsetRMSNorm
from blockspec.layers.rotary import RotaryEmbedding, apply_partial_rotary
from blockspec.models.base import AttentionFn, ForwardOutput
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import MLP, DecoderForCausalLM, LayerTraits
from blockspec.models.gated_deltanet import GatedDeltaNet, LinearAttnDims
from blockspec.models.hybrid_state import RecurrentBatch, RecurrentShape

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridSpec:
    """The hybrid fields of a Qwen3.5 config.json, checked: a bad value fails in one line naming the field."""

    layer_types: tuple[str, ...]  # LINEAR | FULL per layer
    linear: LinearAttnDims
    rotary_dim: int  # dims of each head rotated: partial_rotary_factor x head_dim

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> HybridSpec:
        src, raw, n = cfg.source, cfg.raw, cfg.num_hidden_layers
        types = raw.get("layer_types")
        if types is None:  # as HF: every full_attention_interval-th layer is full attention
            every = cfg.integer("full_attention_interval", default=4, minimum=1)
            types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
        if not isinstance(types, list) or len(types) != n or any(t not in (LINEAR, FULL) for t in types):
            raise ModelLoadError(f"{src}: field 'layer_types' must list {LINEAR!r} or {FULL!r} for each of the "
                                 f"num_hidden_layers={n} layers, got {types!r}")
        # sizes: HF's defaults where the file has none (transformers writes them all)
        kh = cfg.integer("linear_num_key_heads", default=16, minimum=1)
        vh = cfg.integer("linear_num_value_heads", default=32, minimum=1)
        if vh % kh:
            raise ModelLoadError(f"{src}: field 'linear_num_value_heads' must be a multiple of "
                                 f"linear_num_key_heads={kh}, got {vh}")
        dims = LinearAttnDims(kh, vh, cfg.integer("linear_key_head_dim", default=128, minimum=1),
                              cfg.integer("linear_value_head_dim", default=128, minimum=1),
                              cfg.integer("linear_conv_kernel_dim", default=4, minimum=1))
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(f"{src}: field 'num_attention_heads' must be a multiple of num_key_value_heads="
                                 f"{cfg.num_key_value_heads}, got {cfg.num_attention_heads}")
        act = raw.get("hidden_act") or "silu"
        if act != "silu":
            raise ModelLoadError(f"{src}: field 'hidden_act' must be 'silu' for {cfg.architecture}, got {act!r}")
        if not cfg.flag("attn_output_gate", default=True):
            raise ModelLoadError(f"{src}: field 'attn_output_gate' is false; {cfg.architecture} checkpoints gate "
                                 f"their attention output (q_proj holds the gate), ungated is not supported")
        return cls(tuple(types), dims, _rotary_dim(cfg))

    @property
    def kv_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]


def _rotary_dim(cfg: ModelConfig) -> int:
    """partial_rotary_factor x head_dim; the factor from rope_parameters (transformers 5) or the top level, 0.25 (HF's
    default for this family) where neither has it."""
    rope = cfg.raw.get("rope_parameters")
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = cfg.raw.get("partial_rotary_factor", 0.25) if factor is None else factor
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1
    dim = int(cfg.head_dim * factor) if ok else 0
    if dim < 2 or dim % 2:
        raise ModelLoadError(f"{cfg.source}: field 'partial_rotary_factor' must be in (0, 1] and give an even number "
                             f"of rotated dims of head_dim={cfg.head_dim}, got {factor!r}")
    return dim


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj's rows are, per head, head_dim of q then head_dim of gate (packed
    with k and v into qkv_proj at load); out = o_proj(attention * sigmoid(gate))."""

    def __init__(self, cfg: ModelConfig, kv_index: int, bias: bool) -> None:
        super().__init__()
        self.kv_index = kv_index  # this layer's K/V in the pool: its order among the full-attention layers
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.sizes = [2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q_gate = q_gate.view(T, H, 2 * D)
        q, gate = q_gate[..., :D], q_gate[..., D:]
        q = apply_partial_rotary(self.q_norm(q), cos, sin)
        k = apply_partial_rotary(self.k_norm(k.view(T, Hkv, D)), cos, sin)
        out = attn(self.kv_index, q, k, v.view(T, Hkv, D), self.scale)
        return self.o_proj(out.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D)))


class HybridLayer(nn.Module):
    """Pre-norm token mixer (linear_attn or self_attn, by layer type) + MLP, the shared layer's contract plus the
    recurrent state: forward(h, delta, cos, sin, attn, state) -> (h, output, h_in) (models/decoder.DecoderLayer)."""

    def __init__(self, cfg: ModelConfig, spec: HybridSpec, layer_idx: int, traits: LayerTraits, mlp: nn.Module
                 ) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear = spec.layer_types[layer_idx] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, spec.linear, cfg.rms_norm_eps,
                                             spec.linear_layers.index(layer_idx))
        else:
            self.self_attn = GatedAttention(cfg, spec.kv_layers.index(layer_idx), traits.qkv_bias)
        self.mlp = mlp

    def forward(self, h: torch.Tensor | None, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn, state: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if h is None:
            h, x = delta, self.input_layernorm(delta)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        h_in = h
        mixed = self.linear_attn(x, state) if self.linear else self.self_attn(x, cos, sin, attn)
        x, h = self.post_attention_layernorm.add_forward(mixed, h)
        return h, self.mlp(x), h_in


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    packed = {**DecoderForCausalLM.packed, "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1),
              "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3)}

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        bias = cfg.flag("attention_bias")  # as HF: biases on q, k, v and o alike
        return LayerTraits(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def __init__(self, cfg: ModelConfig) -> None:
        self.hybrid = HybridSpec.from_config(cfg)  # read by make_layer, before the stack is built
        super().__init__(cfg)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.hybrid.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return HybridLayer(cfg, self.hybrid, layer_idx, self.traits, self.make_mlp(cfg, layer_idx))

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s feed-forward: the dense SwiGLU here; routed experts in Qwen3.5-MoE."""
        return MLP(cfg)

    @property
    def num_kv_layers(self) -> int:
        """Layers of K/V in the paged pool: the full-attention layers only."""
        return len(self.hybrid.kv_layers)

    def kv_cache_shape(self) -> CacheShape:
        """The target's K/V pool: the full-attention layers only."""
        cfg = self.config
        return CacheShape(self.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim)

    def recurrent_shape(self) -> RecurrentShape:
        """What each sequence's state slot holds (models/hybrid_state.RecurrentState allocates it)."""
        return self.hybrid.linear.state_shape(len(self.hybrid.linear_layers))

    def commit_state(self, state: RecurrentBatch, accepted: torch.Tensor) -> None:
        """After a forward with verify blocks: each block's slots in every linear layer <- the state after its
        accepted rows (accepted [B] int64 per batch position: drafts accepted). On the device, no host sync."""
        for layer in self.layers:
            if layer.linear:
                layer.linear_attn.commit(state, accepted)

    def shard_sizes(self, param: str) -> list[int]:
        if ".linear_attn.in_proj" in param:
            return self.hybrid.linear.in_proj_sizes()
        if ".self_attn.qkv_proj" in param:  # q_proj holds q and the output gate
            cfg = self.config
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [2 * cfg.num_attention_heads * cfg.head_dim, kv, kv]
        return super().shard_sizes(param)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A ConditionalGeneration checkpoint's language model (model.language_model.* -> model.*) as a
        ForCausalLM's; its vision tower (model.visual.*) and every multi-token-prediction head (mtp.*) skipped."""
        for name, t in tensors:
            if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            yield name, t

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionFn,
        tap_layers: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] row indices into T; None -> all rows
        input_embeds: torch.Tensor | None = None,  # [T, hidden]
        state: RecurrentBatch | None = None,  # None: the rows are one sequence from position 0, state not kept
    ) -> ForwardOutput:
        delta = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        if state is None:  # only where the rows are a whole sequence: else its state, or other sequences', is lost
            if not torch.equal(positions, torch.arange(positions.shape[0], device=positions.device)):
                raise ValueError("a hybrid model needs the batch's RecurrentBatch (state=) unless the rows are one "
                                 "sequence from position 0")
            state = RecurrentBatch.single(self.recurrent_shape(), delta.shape[0], delta.dtype, delta.device)
        cos, sin = self.rotary.cos_sin(positions, delta.dtype)  # [T, 1, rotary_dim]
        wanted = {l: i for i, l in enumerate(tap_layers)}
        taps: list[torch.Tensor | None] = [None] * len(tap_layers)
        h = None
        for i, layer in enumerate(self.layers):
            h, delta, h_in = layer(h, delta, cos, sin, attn, state)
            if i - 1 in wanted:  # the stream after layer i-1 (as DecoderForCausalLM.forward)
                taps[wanted[i - 1]] = h_in
        hidden, _ = self.norm.add_forward(delta, h)
        return self.output(hidden, taps, wanted, logit_rows)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A Qwen3.5 vision-language checkpoint served as its language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        print(f"blockspec: {cfg.architecture}: loading the language model only; image and video inputs are not "
              f"supported", file=sys.stderr)
        super().__init__(cfg)
