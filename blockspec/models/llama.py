"""The Llama family (Llama 2 / 3.x; SmolLM2 is a Llama): the shared decoder as it stands, with biases only where
config.json asks for them."""

from __future__ import annotations

from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM, LayerTraits


class LlamaForCausalLM(DecoderForCausalLM):
    gguf_architecture = "llama"

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        # as HF's Llama: attention_bias puts a bias on q, k, v and o alike, mlp_bias on gate, up and down
        bias = cfg.flag("attention_bias")
        return LayerTraits(qkv_bias=bias, o_bias=bias, mlp_bias=cfg.flag("mlp_bias"))
