"""Model families by HF `architectures` name: one line per family, "module:Class", its module imported only when a
config names it (reading a config, listing what is supported or a failed lookup imports no model code)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from blockspec.errors import ModelLoadError

if TYPE_CHECKING:
    from blockspec.models.config import ModelConfig
    from blockspec.models.decoder import DecoderForCausalLM

# Adding a family: its file under models/ and one line here (docs/ARCHITECTURE.md, "Adding a model family").
MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "blockspec.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "blockspec.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "blockspec.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "blockspec.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "blockspec.models.gpt_oss:GptOssForCausalLM",
    "Gemma4ForCausalLM": "blockspec.models.gemma4:Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration": "blockspec.models.gemma4:Gemma4ForConditionalGeneration",
    "Qwen3_5ForCausalLM": "blockspec.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "blockspec.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM": "blockspec.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "blockspec.models.qwen3_5_moe:Qwen3_5MoeForConditionalGeneration",
}


def register(architecture: str, target: str) -> None:
    """Serve `architecture` with the family class at `target` ("module:Class"), from outside this file (a plugin, a
    test); it is imported when a config first names it. Re-registering a name to another class is refused."""
    module, sep, name = target.partition(":")
    if not (sep and module and name):
        raise ValueError(f"model family {target!r} for {architecture!r} must be written 'module:Class'")
    known = MODEL_REGISTRY.get(architecture)
    if known is not None and known != target:
        raise ValueError(f"architecture {architecture!r} is served by {known!r} already")
    MODEL_REGISTRY[architecture] = target


def supported() -> list[str]:
    """The architecture names a config.json may give, sorted."""
    return sorted(MODEL_REGISTRY)


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The family class serving `architecture`, its module imported now; an unknown name fails in one line naming it
    and what is supported."""
    target = MODEL_REGISTRY.get(architecture)
    if target is None:
        raise ModelLoadError(f"unknown architecture {architecture!r} in config.json 'architectures'; "
                             f"supported: {', '.join(supported())}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig) -> DecoderForCausalLM:
    """The target model for `cfg`, its weights not yet loaded (loading/loader.py builds it on the meta device)."""
    return model_class(cfg.architecture)(cfg)


def gguf_architectures() -> dict[str, str]:
    """llama.cpp's `general.architecture` name -> HF architecture name, as each family declares it
    (`gguf_architecture`). Imports every registered family: only reading a GGUF file asks."""
    names: dict[str, str] = {}
    for architecture in MODEL_REGISTRY:
        gguf = model_class(architecture).gguf_architecture
        if gguf is not None:  # llama.cpp files one name for several HF ones at times: the first registered wins
            names.setdefault(gguf, architecture)
    return names
