"""Write DFlash drafters in the z-lab checkpoint format (config.json with dflash_config + model.safetensors); DFlash 2
drafters as z-lab publishes them (architectures ["DFlash2DraftModel"], the DFlash 2 fields in dflash_config, the
selector's codebooks as raw tensors without `.weight`), readable by blockspec and by the `dflash` package alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from blockspec.models.config import ModelConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash2 import DFlash2Config, DFlash2DraftModel
from blockspec.models.dflash_config import DFlashConfig, default_target_layer_ids
from blockspec.train.target_traits import draft_traits

DFLASH2 = "DFlash2DraftModel"


def draft_config_dict(target: ModelConfig, num_layers: int, block_size: int, mask_token_id: int,
                      target_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                      dflash2: dict[str, int] | None = None, sliding_window: int | None = None) -> dict[str, Any]:
    """A z-lab style config.json for a drafter of `target` (attention shape copied from the target, the rest from
    train/target_traits.py); dflash2: the DFlash 2 fields (conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k) for a DFlash 2 drafter. target_layer_ids index all of the target's layers (a hybrid's linear
    layers too). sliding_window W: every layer but the last causal over the W latest positions (z-lab's Qwen3.6
    drafters' pattern: long contexts cost the drafter W keys a layer, the last layer still sees them all)."""
    ids = target_layer_ids if target_layer_ids is not None else \
        default_target_layer_ids(target.num_hidden_layers, 5 if target.num_hidden_layers >= 8 else 1)
    traits = draft_traits(target)
    sliding = ["sliding_attention"] * max(num_layers - 1, 1) if sliding_window is not None else []
    return {
        "architectures": [DFLASH2 if dflash2 else "DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target.hidden_size, "intermediate_size": intermediate_size or traits.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps, "rope_parameters": traits.rope,
        "max_position_embeddings": target.max_position_embeddings, "attention_bias": False,
        "layer_types": sliding + ["full_attention"] * (num_layers - len(sliding)), "sliding_window": sliding_window,
        "vocab_size": target.vocab_size, "block_size": block_size, "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids, "block_size": block_size,
                          **traits.dflash_extra, **(dflash2 or {})},
        "dtype": "bfloat16", "tie_word_embeddings": False,
    }


def zlab_readable(config: dict[str, Any]) -> dict[str, Any]:
    """config with `use_sliding_window` saying what its layers do: true where a sliding layer has a window, so that
    transformers' Qwen3Config (the z-lab package's) keeps it (models/dflash_config.py); as it is otherwise."""
    types = config.get("layer_types") or []
    window = (config.get("dflash_config") or {}).get("sliding_window", config.get("sliding_window"))
    if "sliding_attention" in types and window is not None:
        return dict(config, use_sliding_window=True, sliding_window=window)
    return config


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
    cfg = dict(zlab_readable(config), dtype=str(dtype).replace("torch.", ""))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def is_dflash2(config: dict[str, Any]) -> bool:
    return (config.get("architectures") or [None])[0] == DFLASH2


def random_draft(config: dict[str, Any], seed: int = 0, source: str = "init_draft") -> DFlashDraftModel:
    """A randomly initialized fp32 drafter for a draft_config_dict: weight matrices N(0, 0.02), norms at 1; a DFlash 2
    drafter's additions start neutral (init_dflash2). source names the config in errors."""
    dcfg = (DFlash2Config if is_dflash2(config) else DFlashConfig).from_hf(config, source)
    torch.manual_seed(seed)
    cls = DFlash2DraftModel if isinstance(dcfg, DFlash2Config) else DFlashDraftModel
    model = cls(dcfg, num_taps=len(dcfg.target_layer_ids or []))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # q, k and v drawn as the checkpoint's three tensors: one draw over the packed rows gives other
                # numbers when a block's size is not a multiple of 16, and a seed keeps its drafter
                for part in p.split(model.shard_sizes(name)) if name.endswith("qkv_proj.weight") else [p]:
                    torch.nn.init.normal_(part, std=0.02)
    if isinstance(model, DFlash2DraftModel):
        init_dflash2(model, seed)
    return model


@torch.no_grad()
def init_dflash2(model: DFlash2DraftModel, seed: int) -> None:
    """Start a DFlash 2 drafter's additions neutral, so that it drafts as a DFlash 1 drafter would:
    - each convolution the identity: base kernel 1 at offset 0 and 0 elsewhere, no dynamic part (kernel_projection
      zero; its gradient, the shifted inputs, is not, so it learns from the first step);
    - the selector the argmax: the successor codebook zero, so every score is the candidate's logit. The predecessor
      codebook starts N(0, 1) (nn.Embedding's own init, the reference's module) and the hidden projection N(0, 0.02)
      (random_draft), so the successor codes get a gradient at once; a trilinear score whose three factors all
      started near zero would sit at a saddle and learn slowly.
    A new DFlash 2 drafter thus starts where its block loss alone would take it, and a DFlash 1 drafter upgraded
    with these additions (train/setup.py) drafts exactly as before."""
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    sel = model.candidate_selector
    gen = torch.Generator().manual_seed(seed + 1)
    sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=gen))
    sel.successor_codebook.zero_()


def init_draft(target: ModelConfig, out_dir: str | Path, num_layers: int = 1, block_size: int = 16,
               mask_token_id: int | None = None, seed: int = 0, **kw: Any) -> Path:
    """A randomly initialized drafter for `target` (the starting point of training, or a benchmark stand-in)."""
    mask = mask_token_id if mask_token_id is not None else target.vocab_size - 1
    cfg = draft_config_dict(target, num_layers, block_size, mask, **kw)
    return save_draft(random_draft(cfg, seed), cfg, out_dir, dtype=torch.float32)
