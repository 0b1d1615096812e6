"""The Qwen2 family (Qwen2, Qwen2.5): the shared decoder with biases on q, k and v."""

from __future__ import annotations

from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM, LayerTraits


class Qwen2ForCausalLM(DecoderForCausalLM):
    gguf_architecture = "qwen2"

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        # every Qwen2 checkpoint has q/k/v biases and none on o_proj: HF's Qwen2 has no config field for them
        return LayerTraits(qkv_bias=True)
