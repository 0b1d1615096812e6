"""Tiny DFlash drafters written by the authors' own class (z-lab `dflash` package) for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_zlab_draft(target_cfg, path: Path, *, layers: int = 2, block_size: int = 8, target_layer_ids=(0, 1),
                    mask_token_id: int = 127, seed: int = 0, scale: float = 1.0, **extra: Any):
    """Write a random z-lab DFlashDraftModel for a tiny target via its own save_pretrained; return the module."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=80,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rope_theta=10000.0, use_sliding_window="sliding_window" in extra,
        **{k: v for k, v in extra.items() if k in ("layer_types", "sliding_window")},
    )
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.block_size = block_size
    cfg.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                         **{k: v for k, v in extra.items() if k not in ("layer_types", "sliding_window", "is_causal")}}
    if "is_causal" in extra:
        cfg.is_causal = extra["is_causal"]
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model
