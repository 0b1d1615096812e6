"""Load a DFlash draft checkpoint for a loaded target, validating it against the target before any weight is read,
and prepare it for the target's platform (loading/prepare.py): ready to run, on CUDA with its fused prologue."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from blockspec.config import SpeculativeConfig
from blockspec.errors import ConfigError, ModelLoadError
from blockspec.loading import platform
from blockspec.loading.dflash_options import ResolvedSpec, resolve_spec
from blockspec.loading.loader import LoadedModel
from blockspec.loading.native_stack import attach_draft, draft_fallback
from blockspec.loading.prepare import prepare_draft
from blockspec.loading.source import resolve_source
from blockspec.loading.weights import load_weights
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash2 import DFlash2Config, DFlash2DraftModel
from blockspec.models.dflash_config import DFlashConfig

# z-lab's architecture names -> (config, model): DFlash 1, and DFlash 2 (convolutions + candidate selector)
DRAFT_ARCHITECTURES: dict[str, tuple[type[DFlashConfig], type[DFlashDraftModel]]] = {
    "DFlashDraftModel": (DFlashConfig, DFlashDraftModel),
    "DFlash2DraftModel": (DFlash2Config, DFlash2DraftModel),
}


@dataclass
class LoadedDraft:
    model: DFlashDraftModel
    config: DFlashConfig
    spec: ResolvedSpec
    source: Path | None = None  # the checkpoint directory it was loaded from (None: built in memory)
    draft_vocab_size: int | None = None  # argmax drafts over ids < N (SpeculativeConfig.draft_vocab_size)
    variant: str = platform.DRAFT_PLAIN  # what runs it (platform.drafter_variant)
    reasons: tuple[str, ...] = ()  # why the native drafter was not used, where it was not


def load_draft(spec: SpeculativeConfig, target: LoadedModel) -> LoadedDraft:
    source = resolve_source(spec.draft_model)
    where = str(source.path)
    archs = source.config.get("architectures") or []
    if archs and archs[0] not in DRAFT_ARCHITECTURES:
        raise ModelLoadError(f"{where}: architectures={archs} is not a DFlash draft "
                             f"({' or '.join(map(repr, DRAFT_ARCHITECTURES))})")
    # a config without architectures is read as DFlash 1, as before DFlash 2 existed
    config_class, model_class = DRAFT_ARCHITECTURES[archs[0] if archs else "DFlashDraftModel"]
    cfg = config_class.from_hf(source.config, where)
    cfg.validate_block_size()
    resolved = resolve_spec(spec, cfg, target.config, where)
    n = spec.draft_vocab_size
    if isinstance(cfg, DFlash2Config) and n is not None and n < cfg.selector_top_k:
        # the selector's candidates are the top-k of the argmax head's logits, over ids < draft_vocab_size
        raise ConfigError(f"draft_vocab_size={n} is below this DFlash 2 drafter's selector_top_k="
                          f"{cfg.selector_top_k} (its candidates per position)", field="draft_vocab_size")
    param = next(target.model.parameters())
    if spec.cpu_bf16_draft and (why := platform.check_cpu_bf16_draft(param.device)) is not None:
        raise ModelLoadError(why)
    with torch.device("meta"):
        model = model_class(cfg, num_taps=len(resolved.target_layer_ids))
    model = model.to_empty(device=param.device).to(param.dtype)
    load_weights(model, _zlab_names(source.tensors()), where, prefix="")
    # a target on the native q4 stack drafts on the native kernels too (Q8_0, one call per pass); else a packed
    # target's drafter is packed too, in its dtype, and cpu_bf16_draft packs it in bf16 (platform.drafter_variant)
    variant, reasons = platform.drafter_variant(target.plan, bool(spec.cpu_bf16_draft),
                                                draft_fallback(model, target.model))
    pack = {platform.DRAFT_BF16: torch.bfloat16, platform.DRAFT_PACKED: param.dtype}.get(variant)
    prepare_draft(model, target.model.lm_head, pack, resolved.draft_rows(resolved.num_draft_tokens),
                  spec.draft_vocab_size)
    if variant == platform.DRAFT_NATIVE:
        attach_draft(model, target.model)
    return LoadedDraft(model.eval(), cfg, resolved, source.path if source.path.is_dir() else None,
                       spec.draft_vocab_size, variant, reasons)


def _zlab_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """z-lab stores the DFlash 2 selector's codebooks as raw tensors (`candidate_selector.predecessor_codebook`), as
    our model names them; a checkpoint saved from an nn.Embedding-based copy adds `.weight`: both load."""
    for name, t in tensors:
        if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
            name = name.removesuffix(".weight")
        yield name, t

