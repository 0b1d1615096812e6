"""Model classes by HF `architectures` name."""

from __future__ import annotations

from typing import Callable

from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.models.config import ModelConfig
from blockspec.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.architecture not in MODEL_REGISTRY:
        raise ModelLoadError(
            f"unknown architecture {cfg.architecture!r} in config.json 'architectures'; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[cfg.architecture](cfg)
