"""The drafter a run starts from: a new random one shaped after the target (DFlash 1 or 2), or an exported one
(--init; `--arch dflash2` upgrades a DFlash 1 drafter to DFlash 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from blockspec.config import SpeculativeConfig
from blockspec.errors import BlockspecError
from blockspec.loading.dflash_options import resolve_spec
from blockspec.loading.loader import LoadedModel
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash2 import DFlash2Config, DFlash2DraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.train.export import DFLASH2, draft_config_dict, random_draft
from blockspec.train.trainer import DraftSetup


@dataclass
class DraftShape:
    """What a new drafter looks like; None fields take their defaults (see new_draft)."""

    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    dflash2: dict[str, int] | None = None  # a DFlash 2 drafter with these fields (train.config.DraftArch)
    sliding_window: int | None = None  # every layer but the last causal over this window (export.draft_config_dict)


def new_draft(lm: LoadedModel, shape: DraftShape, seed: int, device: torch.device) -> DraftSetup:
    """A random drafter for lm: attention shape and hidden size of the target, 5 spread-out target layers (1 for
    targets under 8 layers), mask token = the last vocabulary id unless given."""
    if shape.num_layers < 1:
        raise BlockspecError(f"--draft-layers={shape.num_layers} must be >= 1")
    if shape.block_size < 2:
        raise BlockspecError(f"--draft-block-size={shape.block_size} must be >= 2 (slot 0 holds the given token)")
    if shape.intermediate_size is not None and shape.intermediate_size < 1:
        raise BlockspecError(f"--intermediate-size={shape.intermediate_size} must be >= 1")
    if shape.sliding_window is not None and shape.sliding_window < 1:
        raise BlockspecError(f"--sliding-window={shape.sliding_window} must be >= 1")
    mask = shape.mask_token_id if shape.mask_token_id is not None else lm.config.vocab_size - 1
    cfg = draft_config_dict(lm.config, shape.num_layers, shape.block_size, mask, shape.target_layer_ids,
                            shape.intermediate_size, shape.dflash2, shape.sliding_window)
    dcfg = (DFlash2Config if shape.dflash2 else DFlashConfig).from_hf(cfg, "train-draft")
    spec = resolve_spec(SpeculativeConfig(draft_model="train-draft"), dcfg, lm.config, "train-draft")
    return DraftSetup(random_draft(cfg, seed).to(device), cfg, spec.target_layer_ids, spec.mask_token_id)


def draft_from(lm: LoadedModel, path: str, device: torch.device, num_layers: int | None = None,
               seed: int = 0, dflash2: dict[str, int] | None = None) -> DraftSetup:
    """Continue from an exported drafter: its config.json as-is, its weights as fp32 master weights. num_layers
    above the drafter's own appends layers that start as the identity (see grow_layers); dflash2 (the DFlash 2
    fields) turns a DFlash 1 drafter into a DFlash 2 one that drafts as it did (see upgrade_to_dflash2)."""
    from blockspec.loading.draft_loader import load_draft
    from blockspec.loading.source import resolve_source

    loaded = load_draft(SpeculativeConfig(draft_model=path), lm)
    model, config = loaded.model.float(), dict(resolve_source(path).config)
    if dflash2 is not None:
        if isinstance(model, DFlash2DraftModel):
            raise BlockspecError(f"--arch dflash2 --init {path}: that drafter is a DFlash 2 drafter already (its "
                                 f"config.json gives its shape; leave out --arch and the DFlash 2 flags)")
        model, config = upgrade_to_dflash2(model, config, dflash2, seed, f"--init {path}")
    have = model.config.num_hidden_layers
    if num_layers is not None and num_layers != have:
        if num_layers < have:
            raise BlockspecError(f"--draft-layers={num_layers} is below the {have} layers of {path}: a drafter can "
                                 f"grow on --init, not shrink")
        model, config = grow_layers(model, config, num_layers, seed, f"--init {path}")
    model = model.to(device).train().requires_grad_(True)
    return DraftSetup(model, config, loaded.spec.target_layer_ids, loaded.spec.mask_token_id)


def upgrade_to_dflash2(model: DFlashDraftModel, config: dict[str, Any], fields: dict[str, int], seed: int,
                       source: str) -> tuple[DFlash2DraftModel, dict[str, Any]]:
    """The DFlash 1 drafter as a DFlash 2 drafter: its own tensors, plus convolutions and a selector that start
    neutral (identity convolutions, the selector picking the argmax: export.init_dflash2), so it drafts exactly as
    before and training starts from its acceptance."""
    dflash_config = {**(config.get("dflash_config") or {}), **fields}
    config = dict(config, architectures=[DFLASH2], dflash_config=dflash_config)
    upgraded = random_draft(config, seed, source)
    assert isinstance(upgraded, DFlash2DraftModel)
    missing, unexpected = upgraded.load_state_dict(model.state_dict(), strict=False)
    stray = [k for k in missing if not (k.startswith("candidate_selector.") or "_conv." in k)]
    if unexpected or stray:
        raise BlockspecError(f"{source}: cannot upgrade this drafter to DFlash 2: its tensors do not map onto one "
                             f"(unexpected {unexpected}, missing {stray})")
    return upgraded, config


def grow_layers(model: DFlashDraftModel, config: dict[str, Any], num_layers: int, seed: int, source: str
                ) -> tuple[DFlashDraftModel, dict[str, Any]]:
    """The drafter with layers appended up to num_layers. A new layer's two residual branches end in zero matrices
    (o_proj, down_proj), so the grown drafter drafts exactly as before and training starts from its acceptance
    instead of from scratch; the other new matrices are random, so gradients reach the zeros at once."""
    have = model.config.num_hidden_layers
    config = dict(config, num_hidden_layers=num_layers,
                  layer_types=(list(config.get("layer_types") or ["full_attention"] * have)
                               + ["full_attention"] * (num_layers - have)))
    if "num_hidden_layers" in (config.get("dflash_config") or {}):  # there it wins over the top level
        config["dflash_config"] = dict(config["dflash_config"], num_hidden_layers=num_layers)
    grown = random_draft(config, seed, source)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    stray = [k for k in missing if not (k.startswith("layers.") and int(k.split(".")[1]) >= have)]
    if unexpected or stray:
        raise BlockspecError(f"{source}: cannot grow this drafter: its tensors do not map onto the grown one "
                             f"(unexpected {unexpected}, missing {stray})")
    with torch.no_grad():
        for layer in grown.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown, config
