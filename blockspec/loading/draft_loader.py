"""Load a DFlash draft checkpoint for a loaded target, validating it against the target before any weight is read,
and prepare it for the target's platform (loading/prepare.py): ready to run, on CUDA with its fused prologue."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.config import SpeculativeConfig
from blockspec.errors import ModelLoadError
from blockspec.layers import cpu_packed
from blockspec.loading.dflash_options import ResolvedSpec, resolve_spec
from blockspec.loading.loader import LoadedModel
from blockspec.loading.prepare import prepare_draft
from blockspec.loading.source import resolve_source
from blockspec.loading.weights import load_weights
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig


@dataclass
class LoadedDraft:
    model: DFlashDraftModel
    config: DFlashConfig
    spec: ResolvedSpec
    source: Path | None = None  # the checkpoint directory it was loaded from (None: built in memory)
    draft_vocab_size: int | None = None  # argmax drafts over ids < N (SpeculativeConfig.draft_vocab_size)


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
    if spec.cpu_bf16_draft:
        _check_cpu_bf16(param.device)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg, num_taps=len(resolved.target_layer_ids))
    model = model.to_empty(device=param.device).to(param.dtype)
    load_weights(model, source.tensors(), where, prefix="")
    # a packed target's drafter is packed too, in its dtype; cpu_bf16_draft packs it in bf16
    pack = torch.bfloat16 if spec.cpu_bf16_draft else param.dtype if target.cpu_packed else None
    prepare_draft(model, target.model.lm_head, pack, resolved.draft_rows(resolved.num_draft_tokens),
                  spec.draft_vocab_size)
    return LoadedDraft(model.eval(), cfg, resolved, source.path if source.path.is_dir() else None,
                       spec.draft_vocab_size)


def _check_cpu_bf16(device: torch.device) -> None:
    if device.type != "cpu":
        raise ModelLoadError(f"cpu_bf16_draft=True needs the target on the CPU, but it is on {device}")
    if not cpu_packed.bf16_supported(device):
        raise ModelLoadError("cpu_bf16_draft=True needs a CPU with oneDNN bf16 kernels (AVX512-BF16 or AMX); this "
                             "one has none: leave cpu_bf16_draft off")
