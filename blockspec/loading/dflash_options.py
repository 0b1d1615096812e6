"""A DFlash drafter's speculative options resolved: the SpeculativeConfig fields DFlash alone reads (metadata
"methods") merged with the draft checkpoint's dflash_config and checked against the target, before any weight is
read. Here rather than in blockspec/config.py so that the root config names no method's own settings; here rather
than in speculative/ because the loaders below it (draft_loader, train/) resolve them."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.config import SpeculativeConfig
from blockspec.errors import ConfigError
from blockspec.models.config import ModelConfig
from blockspec.models.dflash_config import DFlashConfig


@dataclass
class ResolvedSpec:
    """The speculative settings after merging user overrides with the draft checkpoint and checking the target."""

    num_draft_tokens: int  # K
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int
    probabilistic_drafting: bool
    full_block_drafting: bool = False

    def draft_rows(self, k: int) -> int:
        """Rows of a draft block that proposes k drafts: [bonus, MASK x (rows - 1)]."""
        return self.block_size if self.full_block_drafting else k + 1


def resolve_spec(spec: SpeculativeConfig, draft: DFlashConfig, target: ModelConfig, source: str) -> ResolvedSpec:
    """`spec`'s overrides, else the drafter's config (read from `source`, which the errors name), checked against
    the target: one ConfigError line for the first thing that does not fit."""
    ids = spec.target_layer_ids if spec.target_layer_ids is not None else draft.target_layer_ids
    if ids is None:
        raise ConfigError(
            f"{source}: target_layer_ids is not set (no 'dflash_config.target_layer_ids' or top-level "
            f"'target_layer_ids' in the draft config, and no override); pass target_layer_ids explicitly"
        )
    mask = spec.mask_token_id if spec.mask_token_id is not None else draft.mask_token_id
    if mask is None:
        raise ConfigError(
            f"{source}: mask_token_id is not set (no 'dflash_config.mask_token_id' or top-level 'mask_token_id' "
            f"in the draft config, and no override); pass mask_token_id explicitly"
        )
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(
            f"{source}: draft hidden_size={draft.hidden_size} does not match the target's hidden_size="
            f"{target.hidden_size}; a DFlash draft must be trained for this target"
        )
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ConfigError(f"{source}: target_layer_ids={ids} must be distinct non-negative layer indices, at least one")
    bad = [i for i in ids if i >= target.num_hidden_layers]
    if bad:
        raise ConfigError(
            f"{source}: target_layer_ids={ids} contains {bad[0]}, but the target has only "
            f"{target.num_hidden_layers} layers (ids are 0-based)"
        )
    n = spec.draft_vocab_size
    if n is not None and not 1 <= n <= target.vocab_size:
        raise ConfigError(f"draft_vocab_size={n} is out of range: the target's vocabulary allows "
                          f"1..{target.vocab_size}")
    if not 0 <= mask < target.vocab_size:
        raise ConfigError(f"{source}: mask_token_id={mask} is outside the target vocabulary [0, {target.vocab_size})")
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"{source}: draft vocab_size={draft.vocab_size} does not match the target's vocab_size={target.vocab_size}"
        )
    k = spec.num_draft_tokens if spec.num_draft_tokens is not None else draft.block_size - 1
    if not 1 <= k <= draft.block_size - 1:
        raise ConfigError(
            f"num_draft_tokens={k} is out of range for this draft: block_size={draft.block_size} allows 1.."
            f"{draft.block_size - 1}"
        )
    return ResolvedSpec(k, mask, list(ids), draft.block_size, spec.probabilistic_drafting,
                        bool(spec.full_block_drafting))
