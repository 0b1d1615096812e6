"""Load a DFlash draft checkpoint for a loaded target, validating it against the target before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import ResolvedSpec, SpeculativeConfig, resolve_spec
from blockspec.errors import ModelLoadError
from blockspec.loading.loader import LoadedModel
from blockspec.loading.source import resolve_source
from blockspec.loading.weights import load_weights
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig


@dataclass
class LoadedDraft:
    model: DFlashDraftModel
    config: DFlashConfig
    spec: ResolvedSpec


def load_draft(spec: SpeculativeConfig, target: LoadedModel) -> LoadedDraft:
    source = resolve_source(spec.draft_model)
    where = str(source.path)
    archs = source.config.get("architectures") or []
    if archs and archs[0] not in ("DFlashDraftModel",):
        raise ModelLoadError(f"{where}: architectures={archs} is not a DFlash draft ('DFlashDraftModel')")
    cfg = DFlashConfig.from_hf(source.config, where)
    cfg.validate_block_size()
    resolved = resolve_spec(spec, cfg, target.config, where)
    param = next(target.model.parameters())
    with torch.device("meta"):
        model = DFlashDraftModel(cfg, num_taps=len(resolved.target_layer_ids))
    model = model.to_empty(device=param.device).to(param.dtype)
    load_weights(model, source.tensors(), where, prefix="")
    return LoadedDraft(model.eval(), cfg, resolved)
