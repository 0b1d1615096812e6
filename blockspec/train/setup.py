"""The drafter a run starts from: a new random one shaped after the target, or an exported one (--init)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import SpeculativeConfig, resolve_spec
from blockspec.errors import BlockspecError
from blockspec.loading.loader import LoadedModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.train.export import draft_config_dict, random_draft
from blockspec.train.trainer import DraftSetup


@dataclass
class DraftShape:
    """What a new drafter looks like; None fields take their defaults (see new_draft)."""

    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None


def new_draft(lm: LoadedModel, shape: DraftShape, seed: int, device: torch.device) -> DraftSetup:
    """A random drafter for lm: attention shape and hidden size of the target, 5 spread-out target layers (1 for
    targets under 8 layers), mask token = the last vocabulary id unless given."""
    if shape.num_layers < 1:
        raise BlockspecError(f"--draft-layers={shape.num_layers} must be >= 1")
    if shape.block_size < 2:
        raise BlockspecError(f"--block-size={shape.block_size} must be >= 2 (slot 0 holds the given token)")
    if shape.intermediate_size is not None and shape.intermediate_size < 1:
        raise BlockspecError(f"--intermediate-size={shape.intermediate_size} must be >= 1")
    mask = shape.mask_token_id if shape.mask_token_id is not None else lm.config.vocab_size - 1
    cfg = draft_config_dict(lm.config, shape.num_layers, shape.block_size, mask, shape.target_layer_ids,
                            shape.intermediate_size)
    dcfg = DFlashConfig.from_hf(cfg, "train-draft")
    spec = resolve_spec(SpeculativeConfig(draft_model="train-draft"), dcfg, lm.config, "train-draft")
    return DraftSetup(random_draft(cfg, seed).to(device), cfg, spec.target_layer_ids, spec.mask_token_id)


def draft_from(lm: LoadedModel, path: str, device: torch.device) -> DraftSetup:
    """Continue from an exported drafter: its config.json as-is, its weights as fp32 master weights."""
    from blockspec.loading.draft_loader import load_draft
    from blockspec.loading.source import resolve_source

    loaded = load_draft(SpeculativeConfig(draft_model=path), lm)
    model = loaded.model.float().to(device).train().requires_grad_(True)
    return DraftSetup(model, dict(resolve_source(path).config), loaded.spec.target_layer_ids, loaded.spec.mask_token_id)
