"""Tiny random HF checkpoints (made with transformers, the reference) for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_hf_config(arch: str, **overrides: Any):
    import transformers as tf

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 16, **common})
    raise ValueError(arch)


def make_hf_model(arch: str, seed: int = 0, **overrides: Any):
    import transformers as tf

    cfg = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[arch]
    model = cls(cfg).float().eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the tests see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path
