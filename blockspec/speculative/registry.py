"""Speculative methods by name: SpeculativeConfig.method -> the Proposer that implements it."""

from __future__ import annotations

from typing import Callable

from blockspec.errors import ConfigError
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.speculative.dflash import DFlashProposer
from blockspec.speculative.proposer import Proposer

PROPOSERS: dict[str, Callable[[LoadedDraft], Proposer]] = {"dflash": DFlashProposer}


def build_proposer(draft: LoadedDraft, method: str = "dflash") -> Proposer:
    if method not in PROPOSERS:
        raise ConfigError(f"speculative method={method!r} is not supported (supported: {', '.join(PROPOSERS)})",
                          field="method")
    return PROPOSERS[method](draft)
