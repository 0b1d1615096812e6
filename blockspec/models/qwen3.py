"""The Qwen3 family: the shared decoder with a per-head RMSNorm on q and on k before rotary (`q_norm`, `k_norm`)."""

from __future__ import annotations

from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM, LayerTraits


class Qwen3ForCausalLM(DecoderForCausalLM):
    gguf_architecture = "qwen3"

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        # q/k norm in every Qwen3 (no config field); attention_bias, as in HF's Qwen3, biases q, k, v and o alike
        bias = cfg.flag("attention_bias")
        return LayerTraits(qkv_bias=bias, o_bias=bias, qk_norm=True)
