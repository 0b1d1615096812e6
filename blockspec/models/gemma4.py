"""The Gemma 4 family's text model (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration's language model): what
transformers' Gemma4TextModel computes for text, its layers resolved by models/gemma4_spec.py.

Per layer: attention with per-head RMSNorms on q and k and a weightless one on v, scale 1, rotary of the layer's kind,
sliding-window or full; its output normed before the residual add; a GELU-tanh MLP between a pre- and a post-norm
(with `enable_moe_block`, routed experts beside it: their own router, norms and experts, the two outputs summed);
with `hidden_size_per_layer_input`, a per-layer input (a token embedding of its own plus a projection of the
embeddings) gated into the stream; the whole stream scaled by `layer_scalar`. Embeddings scaled by sqrt(hidden) in
the embedding's dtype; final logits soft-capped (cap * tanh(logits / cap)). Norms weight in fp32 (layers/norm_fp32.py).

The K/V pool holds spec.cache_layers caches of one row shape (spec.cache_heads x spec.cache_dim: `kv_cache_shape`),
which the engine must size the pool by; each layer's k/v are fitted to it (heads repeated, dims zero-padded) and
layers that share K/V attend over the cache of the layer they share with, storing nothing. Not supported: bidirectional
attention over all tokens (`use_bidirectional_attention: "all"`), image / audio / video inputs."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.kv.pool import CacheShape
from blockspec.layers.moe import Router, grouped_experts
from blockspec.layers.norm_fp32 import Fp32RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, apply_rotary
from blockspec.models.base import AttentionFn, ForwardOutput
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM
from blockspec.models.gemma4_spec import Gemma4Spec, MoeShape

_ACT = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}
_TEXT_PREFIX = "model.language_model."
_NOT_TEXT = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def _scale(value: float, weight: torch.Tensor) -> float:
    """An embedding's scale as HF applies it: an fp32 scalar rounded to the embedding's dtype (sqrt(3072) is 55.5 in
    bf16), then multiplied. A Python number (rounded on the host): a device tensor made here would be a host-to-device
    copy inside the captured CUDA step."""
    return float(torch.tensor(value, dtype=torch.float32).to(weight.dtype))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate|up packed into one weight at load; bias-free."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = _ACT[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma4Attention(nn.Module):
    """x [T, hidden] -> [T, hidden]. `qkv_proj` packs q | k | v (q | k where values are the keys, q alone in a layer
    that shares an earlier layer's K/V)."""

    def __init__(self, cfg: ModelConfig, spec: Gemma4Spec, layer_idx: int) -> None:
        super().__init__()
        s = spec.layers[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, s.num_kv_heads, s.head_dim
        self.cache, self.owns_kv, self.k_eq_v = spec.cache_index(layer_idx), s.kv_layer == layer_idx, s.k_eq_v
        kv = self.num_kv_heads * self.head_dim
        self.sizes = [self.num_heads * self.head_dim] + ([kv] * (1 if s.k_eq_v else 2) if self.owns_kv else [])
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=spec.attention_bias)
        self.q_norm = Fp32RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if self.owns_kv:  # a sharing layer has no k/v weights (checkpoints may still carry them: dropped at load)
            self.k_norm = Fp32RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = Fp32RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.repeat, self.pad = spec.cache_heads // self.num_kv_heads, spec.cache_dim - self.head_dim
        self.extra = {} if s.window is None else {"window": s.window}  # what the attention is asked besides

    def fit(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, head_dim] -> the pool's row shape: each K/V head repeated `repeat` times (query head h still meets
        its own K/V head), dims zero-padded (zeros add nothing to a dot product or an output)."""
        if self.repeat > 1:
            x = x.repeat_interleave(self.repeat, dim=1)
        return F.pad(x, (0, self.pad)) if self.pad else x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        parts = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = apply_rotary(self.q_norm(parts[0].view(T, self.num_heads, D)), cos, sin)
        k = v = None  # a sharing layer: read the cache, store nothing
        if self.owns_kv:
            k_raw = parts[1].view(T, self.num_kv_heads, D)
            v_raw = k_raw if self.k_eq_v else parts[2].view(T, self.num_kv_heads, D)
            k, v = self.fit(apply_rotary(self.k_norm(k_raw), cos, sin)), self.fit(self.v_norm(v_raw))
        q = F.pad(q, (0, self.pad)) if self.pad else q
        out = attn(self.cache, q, k, v, 1.0, **self.extra)  # type: ignore[call-arg]  # scale 1: q and k are normed
        return self.o_proj(out[..., :D].reshape(T, self.num_heads * D))


class Gemma4Router(nn.Module):
    """The MoE half's router (HF's `router.*`): a weightless norm of the residual stream, * scale / sqrt(hidden), the
    projection, softmax in fp32, the top k renormalized, * per_expert_scale. The experts (GatedMLP each, `experts.{e}`)
    run over their own pre-norm (Gemma4DecoderLayer)."""

    def __init__(self, cfg: ModelConfig, moe: MoeShape) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.norm = Fp32RMSNorm(H, cfg.rms_norm_eps, with_scale=False)
        self.proj = Router(H, moe.num_experts, bias=False)  # never packed or quantized (layers/moe.py)
        self.scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.top_k, self.root = moe.top_k, H**-0.5

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.proj(self.norm(h) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: Gemma4Spec, layer_idx: int) -> None:
        super().__init__()
        H, eps, s = cfg.hidden_size, cfg.rms_norm_eps, spec.layers[layer_idx]
        self.kind = s.kind
        self.self_attn = Gemma4Attention(cfg, spec, layer_idx)
        self.mlp = GatedMLP(H, s.intermediate, spec.activation)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Fp32RMSNorm(H, eps))
        self.router: Gemma4Router | None = None
        if spec.moe is not None:  # HF's names: router.*, experts.{e}.*, three more norms
            self.router = Gemma4Router(cfg, spec.moe)
            self.experts = nn.ModuleList(GatedMLP(H, spec.moe.intermediate, spec.activation)
                                         for _ in range(spec.moe.num_experts))
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, Fp32RMSNorm(H, eps))
        if spec.per_layer_dim:
            self.per_layer_input_gate = nn.Linear(H, spec.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(spec.per_layer_dim, H, bias=False)
            self.post_per_layer_input_norm = Fp32RMSNorm(H, eps)
        self.act = _ACT[spec.activation]
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)  # a parameter so that it loads

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                per_layer: torch.Tensor | None) -> torch.Tensor:
        """The residual stream h [T, hidden] -> after this layer; per_layer [T, per_layer_dim] (None: none)."""
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, attn))
        x = self.mlp(self.pre_feedforward_layernorm(h))
        if self.router is not None:
            weights, ids = self.router.route(h)  # routed on the stream before the feed-forward, as HF does
            routed = grouped_experts(self.pre_feedforward_layernorm_2(h), weights, ids, self.experts)
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(x)
        if per_layer is not None:
            x = self.per_layer_projection(self.act(self.per_layer_input_gate(h)) * per_layer)
            h = h + self.post_per_layer_input_norm(x)
        return h * self.layer_scalar


class Gemma4ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        self.spec = Gemma4Spec.from_config(cfg)  # make_layer reads it; a plain attribute, as nn.Module allows
        super().__init__(cfg)
        s, H = self.spec, cfg.hidden_size
        self.norm = Fp32RMSNorm(H, cfg.rms_norm_eps)
        dims = {layer.kind: layer.head_dim for layer in s.layers}
        self.rotaries = {kind: RotaryEmbedding(dims[kind], *s.rope[kind], cfg.max_position_embeddings)
                         for kind in sorted(s.rope)}
        self.rotary = self.rotaries[s.layers[0].kind]
        if s.per_layer_dim:  # HF's names: embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm
            L = cfg.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(s.per_layer_vocab, L * s.per_layer_dim)
            self.per_layer_model_projection = nn.Linear(H, L * s.per_layer_dim, bias=False)
            self.per_layer_projection_norm = Fp32RMSNorm(s.per_layer_dim, cfg.rms_norm_eps)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return Gemma4DecoderLayer(cfg, self.spec, layer_idx)

    def kv_cache_shape(self) -> CacheShape:
        """The target's K/V pool: one cache per layer that computes K/V, rows of the widest layer's shape."""
        return CacheShape(self.spec.cache_layers, self.spec.cache_heads, self.spec.cache_dim)

    def shard_sizes(self, param: str) -> list[int]:
        """Per layer (head shapes and MLP widths vary): "layers.3.self_attn.qkv_proj.weight" -> q, k(, v) rows."""
        head, fused, _ = param.rsplit(".", 2)
        if fused == "qkv_proj":
            return list(self.get_submodule(head).sizes)
        return [self.get_submodule(f"{head}.{fused}").out_features // 2] * 2  # a packed gate|up

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the embeddings look up (the conditional-generation model blanks its media placeholders)."""
        return input_ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids) * _scale(self.config.hidden_size**0.5, self.embed_tokens.weight)

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, per_layer_dim]: (norm(projection of the embeddings) + per-layer token embedding) / sqrt(2)."""
        T, L, P = ids.shape[0], self.config.num_hidden_layers, self.spec.per_layer_dim
        tokens = self.embed_tokens_per_layer(ids) * _scale(P**0.5, self.embed_tokens_per_layer.weight)
        proj = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(proj.view(T, L, P)) + tokens.view(T, L, P)) * 2.0**-0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # in the head's dtype, as HF caps
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionFn,
        tap_layers: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,  # [R] row indices into T; None -> all rows
        input_embeds: torch.Tensor | None = None,  # [T, hidden] overrides the embedding lookup
    ) -> ForwardOutput:
        ids = self.text_ids(input_ids)
        h = self.embed(ids) if input_embeds is None else input_embeds
        per_layer = self.per_layer_inputs(ids, h) if self.spec.per_layer_dim else None
        rope = {kind: r.cos_sin(positions, h.dtype) for kind, r in self.rotaries.items()}
        wanted = {l: i for i, l in enumerate(tap_layers)}
        taps: list[torch.Tensor | None] = [None] * len(tap_layers)
        for i, layer in enumerate(self.layers):
            h = layer(h, *rope[layer.kind], attn, None if per_layer is None else per_layer[:, i])
            if i in wanted:
                taps[wanted[i]] = h
        return self.output(self.norm(h), taps, wanted, logit_rows)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A conditional-generation checkpoint's language model (model.language_model.* -> model.*), its media towers
        skipped; the k/v weights sharing layers do not use dropped; stacked expert banks (experts.gate_up_proj
        [E, 2I, H], experts.down_proj [E, H, I]) split per expert under per-module names; a layer_scalar the
        checkpoint leaves out is 1 (what HF initializes it to)."""
        scalars = set(range(len(self.layers)))
        for name, t in tensors:
            if name.startswith(_NOT_TEXT):
                continue
            if name.startswith(_TEXT_PREFIX):
                name = "model." + name[len(_TEXT_PREFIX):]
            parts = name.split(".")
            if len(parts) == 4 and parts[1] == "layers" and parts[3] == "layer_scalar":
                scalars.discard(int(parts[2]))
            if len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn" \
                    and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm") \
                    and not self.layers[int(parts[2])].self_attn.owns_kv:
                continue
            if len(parts) == 5 and parts[3] == "experts" and parts[4] in ("gate_up_proj", "down_proj"):
                for e in range(t.shape[0]):
                    if parts[4] == "down_proj":
                        yield f"{'.'.join(parts[:4])}.{e}.down_proj.weight", t[e]
                    else:
                        gate, up = t[e].chunk(2, dim=0)
                        yield f"{'.'.join(parts[:4])}.{e}.gate_proj.weight", gate
                        yield f"{'.'.join(parts[:4])}.{e}.up_proj.weight", up
                continue
            yield name, t
        for i in sorted(scalars):
            yield f"model.layers.{i}.layer_scalar", torch.ones(1)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A Gemma 4 multimodal checkpoint served as its language model (text in, text out)."""

    def __init__(self, cfg: ModelConfig) -> None:
        print(f"blockspec: {cfg.architecture}: loading the language model only; image, video and audio inputs are "
              f"not supported", file=sys.stderr)
        super().__init__(cfg)
        # HF looks up its media placeholders' ids as the pad token in both embeddings
        self.media_ids = [int(cfg.raw[k]) for k in ("image_token_id", "video_token_id", "audio_token_id")
                          if isinstance(cfg.raw.get(k), int)]
        self.pad_id = int(cfg.raw.get("pad_token_id") or 0)

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.media_ids:
            return input_ids
        media = torch.isin(input_ids, torch.tensor(self.media_ids, device=input_ids.device))
        return torch.where(media, torch.full_like(input_ids, self.pad_id), input_ids)
