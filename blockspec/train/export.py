"""Write DFlash drafters in the z-lab checkpoint format (config.json with dflash_config + model.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from blockspec.models.config import ModelConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig, default_target_layer_ids


def draft_config_dict(target: ModelConfig, num_layers: int, block_size: int, mask_token_id: int,
                      target_layer_ids: list[int] | None = None, intermediate_size: int | None = None) -> dict[str, Any]:
    """A z-lab style config.json for a drafter of `target` (attention shape copied from the target)."""
    ids = target_layer_ids if target_layer_ids is not None else \
        default_target_layer_ids(target.num_hidden_layers, 5 if target.num_hidden_layers >= 8 else 1)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": target.rope_theta}
    if target.rope_scaling:
        rope = {**target.rope_scaling, "rope_theta": target.rope_theta}
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps, "rope_parameters": rope,
        "max_position_embeddings": target.max_position_embeddings, "attention_bias": False,
        "layer_types": ["full_attention"] * num_layers, "sliding_window": None,
        "vocab_size": target.vocab_size, "block_size": block_size, "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids, "block_size": block_size},
        "dtype": "bfloat16", "tie_word_embeddings": False,
    }


def hf_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """Our parameters under the checkpoint's tensor names (packed qkv_proj / gate_up_proj split back into q_proj,
    k_proj, v_proj / gate_proj, up_proj)."""
    parts: dict[str, dict[int, str]] = {}  # our packed name -> shard index -> checkpoint name
    for hf_part, (ours, idx) in model.packed.items():
        parts.setdefault(ours, {})[idx] = hf_part
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")  # "layers.0.self_attn.qkv_proj", "weight"
        parent, _, packed = module.rpartition(".")  # "layers.0.self_attn", "qkv_proj"
        if packed not in parts:
            out[name] = p.detach().contiguous()
            continue
        for idx, t in enumerate(p.detach().split(model.shard_sizes(name))):
            out[f"{parent}.{parts[packed][idx]}.{leaf}"] = t.contiguous()
    return out


def save_draft(model: DFlashDraftModel, config: dict[str, Any], out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).cpu() for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config, dtype=str(dtype).replace("torch.", ""))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def random_draft(config: dict[str, Any], seed: int = 0, source: str = "init_draft") -> DFlashDraftModel:
    """A randomly initialized fp32 drafter for a draft_config_dict: weight matrices N(0, 0.02), norms at 1.
    source names the config in errors."""
    dcfg = DFlashConfig.from_hf(config, source)
    torch.manual_seed(seed)
    model = DFlashDraftModel(dcfg, num_taps=len(dcfg.target_layer_ids or []))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # q, k and v drawn as the checkpoint's three tensors: one draw over the packed rows gives other
                # numbers when a block's size is not a multiple of 16, and a seed keeps its drafter
                for part in p.split(model.shard_sizes(name)) if name.endswith("qkv_proj.weight") else [p]:
                    torch.nn.init.normal_(part, std=0.02)
    return model


def init_draft(target: ModelConfig, out_dir: str | Path, num_layers: int = 1, block_size: int = 16,
               mask_token_id: int | None = None, seed: int = 0, **kw: Any) -> Path:
    """A randomly initialized drafter for `target` (the starting point of training, or a benchmark stand-in)."""
    mask = mask_token_id if mask_token_id is not None else target.vocab_size - 1
    cfg = draft_config_dict(target, num_layers, block_size, mask, **kw)
    return save_draft(random_draft(cfg, seed), cfg, out_dir, dtype=torch.float32)
