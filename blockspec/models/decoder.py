"""The decoder every model family shares, written for inference, and the forward contract every target keeps.

A family (models/llama.py, qwen2.py, qwen3.py) is a subclass of DecoderForCausalLM in a file of its own: it says what
it adds to the shared layer (`LayerTraits`, derived from its config.json fields) and, where llama.cpp has one, its GGUF
architecture name; models/registry.py finds it by the HF `architectures` name (docs/ARCHITECTURE.md, "Adding a model
family").

q/k/v and gate/up are packed into one matmul each at load time. The forward runs over a flat [T] token layout with
explicit positions, so single-request, batched and speculative callers share it; attention is delegated to the
AttentionFn the caller passes (dense cache, paged reference, Triton)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kv.pool import CacheShape
from blockspec.layers import kernels
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, apply_rotary
from blockspec.models.base import AttentionFn, ForwardOutput, packed_shard_sizes
from blockspec.models.config import ModelConfig
from blockspec.models.executor import TargetStackExecutor


@dataclass(frozen=True)
class LayerTraits:
    """What a family adds to the shared decoder layer. Each family derives them from its own config.json fields
    (`DecoderForCausalLM.layer_traits`), so no shared code compares architecture names."""

    qkv_bias: bool = False  # biases on q, k and v
    o_bias: bool = False  # a bias on o_proj (HF's attention_bias puts one there as well as on q, k and v)
    mlp_bias: bool = False  # biases on gate, up and down (Llama's mlp_bias)
    qk_norm: bool = False  # a per-head RMSNorm on q and on k before rotary (Qwen3)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, traits: LayerTraits) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=traits.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=traits.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        qn, kn = self.q_norm, self.k_norm
        if kernels.fused(qkv) and (qn is None or qn.weight.dtype == qkv.dtype):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            norms = (qn.weight, kn.weight, qn.eps) if qn is not None else (None, None, 0.0)
            # an attention over the paged pool may take k/v straight into its caches (k = v = None then)
            q, k, v = split_qkv_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *norms, cos, sin,
                                          attn.kv_destination(self.layer_idx))
        else:
            heads = qkv.view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            if qn is not None:
                q, k = apply_rotary(qn(q), cos, sin), apply_rotary(kn(k), cos, sin)
            else:  # q and k rotated in one pass over their heads (the same arithmetic per element, fewer eager ops)
                q, k = apply_rotary(heads[:, :self.num_heads + self.num_kv_heads], cos, sin).split(
                    [self.num_heads, self.num_kv_heads], dim=1)
        out = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU over packed gate|up rows. The DFlash drafter's layers use it too (any config with hidden_size and
    intermediate_size), hence `bias` alone rather than the traits."""

    def __init__(self, cfg: ModelConfig, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.fused(gate_up):  # the Triton kernel has no backward
            from blockspec.layers.triton_norm import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP. `mlp`: a family's own feed-forward module (x [T, hidden] -> [T, hidden]) in place of
    the dense SwiGLU, e.g. routed experts (models/qwen3_moe.py); None: the dense MLP of `cfg.intermediate_size`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, traits: LayerTraits, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, traits)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg, traits.mlp_bias)

    def forward(self, h: torch.Tensor | None, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream h (None before layer 0, where delta is the embedding) and the previous layer's output
        delta -> (h, this layer's output, the stream this layer started from = the previous layer's output stream).
        The add of each output into the stream is fused with the next norm."""
        if h is None:
            h, x = delta, self.input_layernorm(delta)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        h_in = h
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, attn), h)
        return h, self.mlp(x), h_in


class DecoderForCausalLM(nn.Module):
    """The shared stack under every family. A family sets what differs and nothing else: `layer_traits` (from its
    config.json fields), `gguf_architecture` (llama.cpp's name for it, None where there is none) and, for a layer that
    differs beyond the traits (a mixture-of-experts MLP, say), `make_layer`. Parameter names are HF's, less the
    `model.` prefix, with q/k/v and gate/up packed (`packed`), so loading/weights.py loads every family alike."""

    gguf_architecture: ClassVar[str | None] = None
    # HF checkpoint names that we pack: hf suffix -> (our param suffix, shard index)
    packed: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        """What this family adds to the shared layer, from its config.json fields (`cfg.flag`)."""
        return LayerTraits()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.traits = self.layer_traits(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # runs the layer stack in one call where it can (the native q4 stack: loading/native_stack.py attaches it)
        self.executor: TargetStackExecutor | None = None

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx`: forward(h, delta, cos, sin, attn) -> (h, output, h_in), as DecoderLayer's."""
        return DecoderLayer(cfg, layer_idx, self.traits)

    def kv_cache_shape(self) -> CacheShape:
        """The target's K/V pool: one cache per layer, rows of the config's K/V heads x head size. What the engine
        sizes its pool by; a family whose layers do not all keep K/V of one shape answers for itself (Gemma 4:
        layers sharing K/V, head shapes padded to the widest; Qwen3.5: full-attention layers only)."""
        cfg = self.config
        return CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)

    def shard_sizes(self, param: str) -> list[int]:
        """Row sizes of the shards packed into a fused parameter (for the loader)."""
        return packed_shard_sizes(self.config, param)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (HF name, tensor) pairs as loading/weights.py takes them: one tensor per HF parameter.
        The identity here; a family whose checkpoints may store several parameters in one tensor (transformers 5's
        stacked expert banks, say) splits them here, lazily."""
        return tensors

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionFn,
        tap_layers: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] row indices into T; None -> all rows
        input_embeds: torch.Tensor | None = None,  # [T, hidden] overrides the embedding lookup
    ) -> ForwardOutput:
        delta = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary.cos_sin(positions, delta.dtype)
        ran = self.executor.run_layers(delta, cos, sin, attn, tap_layers) if self.executor is not None else None
        if ran is not None:
            hidden, tapped = ran
            rows = hidden if logit_rows is None else hidden[logit_rows]
            return ForwardOutput(logits=self.compute_logits(rows), taps=tapped, hidden=hidden)
        wanted = {l: i for i, l in enumerate(tap_layers)}
        taps: list[torch.Tensor | None] = [None] * len(tap_layers)
        h = None
        for i, layer in enumerate(self.layers):
            h, delta, h_in = layer(h, delta, cos, sin, attn)
            if i - 1 in wanted:  # the stream after layer i-1: the sum layer i's fused add-norm just formed
                taps[wanted[i - 1]] = h_in
        hidden, _ = self.norm.add_forward(delta, h)
        return self.output(hidden, taps, wanted, logit_rows)

    def output(self, hidden: torch.Tensor, taps: list[torch.Tensor | None], wanted: dict[int, int],
               logit_rows: torch.Tensor | None) -> ForwardOutput:
        """Every family's forward ends here: hidden [T, hidden] final-normed; taps filled for every tapped layer but
        the last, whose tap is `hidden` (HF's hidden_states[n] is the final-normed output; drafters are trained on
        that); logits at logit_rows."""
        last = len(self.layers) - 1
        if last in wanted:
            taps[wanted[last]] = hidden
        rows = hidden if logit_rows is None else hidden[logit_rows]
        return ForwardOutput(
            logits=self.compute_logits(rows),
            taps=torch.cat(taps, dim=-1) if taps else None,  # type: ignore[arg-type]
            hidden=hidden,
        )
