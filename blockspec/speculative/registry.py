"""Speculative methods by name: SpeculativeConfig.method -> the Proposer that implements it, built for a target."""

from __future__ import annotations

from typing import Callable

from blockspec.config import DEFAULT_NGRAM_DRAFT_TOKENS, DEFAULT_NGRAM_MAX, SpeculativeConfig
from blockspec.errors import ConfigError
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.loading.source import resolve_source
from blockspec.speculative.dflash import DFlashProposer
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.ngram import NgramProposer
from blockspec.speculative.proposer import Proposer


def _dflash(spec: SpeculativeConfig, target: LoadedModel) -> Proposer:
    return DFlashProposer(load_draft(spec, target))


def _ngram(spec: SpeculativeConfig, target: LoadedModel) -> Proposer:
    return NgramProposer(spec.num_draft_tokens or DEFAULT_NGRAM_DRAFT_TOKENS, spec.ngram_max or DEFAULT_NGRAM_MAX)


def _draft_model(spec: SpeculativeConfig, target: LoadedModel) -> Proposer:
    if spec.num_draft_tokens is None:  # before any weight is read
        why = "" if spec.method else f" ({spec.draft_model} is no DFlash drafter, so it drafts as a classic draft model)"
        raise ConfigError(f"num_draft_tokens is required with method 'draft-model'{why} (K drafts per step, e.g. 4)",
                          field="num_draft_tokens")
    param = next(target.model.parameters())
    # the draft model runs beside the target: on its device, in its dtype, packed for oneDNN where the target is
    config = LoadConfig(device=str(param.device), dtype=str(param.dtype).removeprefix("torch."), with_tokenizer=False,
                        cpu_packed=target.cpu_packed)
    draft = load_model(spec.draft_model, config)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"{spec.draft_model}: draft model vocab_size={draft.config.vocab_size} differs from the "
                          f"target's vocab_size={target.config.vocab_size}; a draft model must share the target's "
                          f"tokenizer", field="draft_model")
    return DraftModelProposer(draft, spec.num_draft_tokens)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, LoadedModel], Proposer]] = {
    "dflash": _dflash, "ngram": _ngram, "draft-model": _draft_model}


def method_of(spec: SpeculativeConfig) -> str:
    """The method asked for, or the one the draft checkpoint implies: a DFlash drafter or a plain causal LM."""
    if spec.method is not None:
        return spec.method
    archs = resolve_source(spec.draft_model).config.get("architectures") or []
    return "dflash" if {"DFlashDraftModel", "DFlash2DraftModel"} & set(archs) else "draft-model"


def load_proposer(spec: SpeculativeConfig, target: LoadedModel) -> Proposer:
    return PROPOSERS[method_of(spec)](spec, target)


def as_proposer(draft: Proposer | LoadedDraft | None) -> Proposer | None:
    """What the engine takes: a proposer, or a loaded DFlash drafter (the common case of the Python API)."""
    return DFlashProposer(draft) if isinstance(draft, LoadedDraft) else draft
