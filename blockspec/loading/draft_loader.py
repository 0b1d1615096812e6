"""Load a DFlash draft checkpoint for a loaded target, validating it against the target before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import ResolvedSpec, SpeculativeConfig, resolve_spec
from blockspec.errors import ModelLoadError
from blockspec.layers import cpu_packed
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
    if spec.cpu_bf16_draft:
        _check_cpu_bf16(param.device)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg, num_taps=len(resolved.target_layer_ids))
    model = model.to_empty(device=param.device).to(param.dtype)
    load_weights(model, source.tensors(), where, prefix="")
    lm_head = target.model.lm_head
    if spec.cpu_bf16_draft or target.cpu_packed:  # a packed target's drafter is packed too, in its dtype
        model.pack_cpu(lm_head, torch.bfloat16 if spec.cpu_bf16_draft else param.dtype,
                       resolved.draft_rows(resolved.num_draft_tokens), vocab=spec.draft_vocab_size)
    elif spec.draft_vocab_size is not None:
        model.set_draft_vocab(lm_head, spec.draft_vocab_size)
    return LoadedDraft(model.eval(), cfg, resolved)


def _check_cpu_bf16(device: torch.device) -> None:
    if device.type != "cpu":
        raise ModelLoadError(f"cpu_bf16_draft=True needs the target on the CPU, but it is on {device}")
    if not cpu_packed.bf16_supported(device):
        raise ModelLoadError("cpu_bf16_draft=True needs a CPU with oneDNN bf16 kernels (AVX512-BF16 or AMX); this "
                             "one has none: leave cpu_bf16_draft off")
