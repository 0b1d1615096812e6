"""The gpt-oss family (gpt-oss-20b, gpt-oss-120b): the shared decoder with

- learned attention sinks: per head one logit that joins the softmax's denominator and adds no value
  (`self_attn.sinks` [heads]), passed to the attention with the layer's window;
- sliding-window and full-attention layers alternating (`layer_types`, `sliding_window`: a query at p sees the keys
  in (p - window, p] in a sliding layer), honoured by the paged attention itself (attention/paged_ref.py,
  triton_paged.py), so prefill, decode and verify rows alike;
- q/k/v/o biases (`attention_bias`, true unless the config says otherwise), YaRN rotary (the HF default when the
  config gives none), norms weighted in fp32 (HF keeps them in fp32);
- a mixture of experts in every layer: the router's top-k logits (with a bias) softmaxed among themselves, experts with
  biases and a clamped SwiGLU (layers/gpt_oss_moe.py).

Checkpoints: transformers' names; the expert banks stacked (`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up
interleaved, `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]), split per expert here
(`checkpoint_tensors`), or as the released checkpoints store them, in MXFP4 (`*_blocks` + `*_scales`), dequantized
on the CPU at load by loading/mxfp4.py before they get here; or llama.cpp's gpt-oss GGUF (loading/gguf_gpt_oss.py:
its names, MXFP4 banks dequantized by the gguf package)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.layers.gpt_oss_moe import ClampedSwiGLUExpert, TopKSoftmaxMoeBlock
from blockspec.layers.norm_fp32 import Fp32RMSNorm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models import fields
from blockspec.models.base import AttentionFn, PagedDest, packed_shard_sizes
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM, DecoderLayer, LayerTraits

# the stacked expert banks and their biases: (prefix)mlp.experts.gate_up_proj[_bias] | down_proj[_bias]
_BANK = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
# transformers' GptOssConfig defaults, for a config.json that leaves the rotary out
_DEFAULT_THETA = 150000.0
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssSpec:
    """gpt-oss's own config.json fields, checked (one line naming the field) before any weight is allocated."""

    num_experts: int  # num_local_experts (num_experts: transformers' alias)
    top_k: int  # num_experts_per_tok
    swiglu_alpha: float
    swiglu_limit: float
    layer_types: tuple[str, ...]  # per layer fields.SLIDING or fields.FULL
    sliding_window: int | None  # None: no sliding layer

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "GptOssSpec":
        raw = cfg.raw
        if raw.get("num_experts") is not None and raw.get("num_local_experts") is not None \
                and raw["num_experts"] != raw["num_local_experts"]:
            fields.fail(cfg, "num_experts", f"={raw['num_experts']!r} disagrees with 'num_local_experts'="
                                            f"{raw['num_local_experts']!r}")
        key = "num_experts" if raw.get("num_local_experts") is None and raw.get("num_experts") is not None \
            else "num_local_experts"
        experts = fields.integer(cfg, key, minimum=1)
        top_key = "num_experts_per_tok" if raw.get("num_experts_per_tok") is not None or \
            raw.get("experts_per_token") is None else "experts_per_token"  # the latter: OpenAI's own key
        top_k = fields.integer(cfg, top_key, minimum=1)
        if top_k > experts:
            fields.fail(cfg, top_key, f"must be at most {key}={experts}, got {top_k}")
        # HF's default: even layers slide, odd layers attend to everything
        types = fields.layer_types(cfg, [fields.SLIDING if i % 2 == 0 else fields.FULL
                                         for i in range(cfg.num_hidden_layers)])
        alpha = fields.number(cfg, "swiglu_alpha", 1.702, positive=True)
        limit = fields.number(cfg, "swiglu_limit", 7.0, positive=True)
        return cls(experts, top_k, alpha, limit, tuple(types), fields.sliding_window(cfg, types))  # type: ignore

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == fields.SLIDING else None


def rope(cfg: ModelConfig) -> tuple[float, dict | None]:
    """(theta, scaling) as HF's GptOssConfig resolves them: its YaRN default where config.json gives no rotary at all,
    150000 where it gives no theta."""
    raw, params = cfg.raw, cfg.raw.get("rope_parameters")
    given = raw.get("rope_scaling") is not None or isinstance(params, dict)
    theta = raw.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None)
    return float(theta or _DEFAULT_THETA), (cfg.rope_scaling if given else dict(_DEFAULT_YARN))


class LayerAttention:
    """The forward's AttentionFn with one layer's window and sinks bound, so the shared Attention module's call
    `attn(layer, q, k, v, scale)` asks for them (attention/paged_ref.py: PagedTargetAttention takes both)."""

    def __init__(self, attn: AttentionFn, window: int | None, sinks: torch.Tensor) -> None:
        self.attn = attn
        self.extra: dict[str, object] = {"sinks": sinks} if window is None else {"sinks": sinks, "window": window}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        return self.attn(layer, q, k, v, scale, **self.extra)  # type: ignore[call-arg]

    def kv_destination(self, layer: int) -> PagedDest | None:
        return self.attn.kv_destination(layer)


class GptOssDecoderLayer(DecoderLayer):
    """The shared pre-norm layer with sinks on its attention, its window, fp32-weighted norms and routed experts."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, traits: LayerTraits, spec: GptOssSpec) -> None:
        H, inter = cfg.hidden_size, cfg.intermediate_size
        experts = nn.ModuleList(ClampedSwiGLUExpert(H, inter, spec.swiglu_alpha, spec.swiglu_limit)
                                for _ in range(spec.num_experts))
        super().__init__(cfg, layer_idx, traits, mlp=TopKSoftmaxMoeBlock(H, experts, spec.top_k))
        self.self_attn.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))  # HF's name: self_attn.sinks
        self.input_layernorm = Fp32RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(H, cfg.rms_norm_eps)
        self.window = spec.window(layer_idx)

    def forward(self, h: torch.Tensor | None, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().forward(h, delta, cos, sin, LayerAttention(attn, self.window, self.self_attn.sinks))

    def extra_repr(self) -> str:
        return f"window={self.window}"


class GptOssForCausalLM(DecoderForCausalLM):
    gguf_architecture = "gpt-oss"  # llama.cpp's tensor names and keys: loading/gguf_gpt_oss.py

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        bias = cfg.flag("attention_bias", default=True)  # HF's GptOssConfig: true unless said otherwise
        return LayerTraits(qkv_bias=bias, o_bias=bias)

    def __init__(self, cfg: ModelConfig) -> None:
        self.spec = GptOssSpec.from_config(cfg)  # make_layer reads it; a plain attribute, as nn.Module allows
        super().__init__(cfg)
        self.norm = Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        theta, scaling = rope(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, theta, scaling, cfg.max_position_embeddings)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return GptOssDecoderLayer(cfg, layer_idx, self.traits, self.spec)

    def shard_sizes(self, param: str) -> list[int]:
        if ".experts." in param:  # an expert's packed gate|up (weight or bias)
            return [self.config.intermediate_size, self.config.intermediate_size]
        return packed_shard_sizes(self.config, param)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each stacked bank split into per-expert tensors under HF's per-module names (gate_proj / up_proj /
        down_proj .weight / .bias), gate and up de-interleaved (gate the even rows of HF's bank), the weights
        transposed to nn.Linear's [out, in]; views, copied once into the parameters. A GGUF's `sinks.weight` as HF's
        `sinks`. Every other tensor as it is."""
        E, H, inter = self.spec.num_experts, self.config.hidden_size, self.config.intermediate_size
        for name, t in tensors:
            if name.endswith(".self_attn.sinks.weight"):  # a GGUF's name for it (llama.cpp's converter adds .weight)
                name = name[:-len(".weight")]
            m = _BANK.fullmatch(name)
            if m is None:
                yield name, t
                continue
            prefix, kind, bias = m.groups()
            rows = 2 * inter if kind == "gate_up_proj" else H
            want = (E, rows) if bias else (E, H, rows) if kind == "gate_up_proj" else (E, inter, H)
            if tuple(t.shape) != want:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}; the config expects {want} "
                                     f"(num_local_experts, ...)")
            part = "bias" if bias else "weight"
            for e in range(E):
                w = t[e] if bias else t[e].transpose(0, 1)  # [out(, in)]
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.{part}", w
                else:
                    yield f"{prefix}.{e}.gate_proj.{part}", w[0::2]
                    yield f"{prefix}.{e}.up_proj.{part}", w[1::2]
