"""What a new drafter takes from its target beyond the hidden size and the attention shape (train/export.py's
draft_config_dict), where the target's config does not say it plainly: the MLP width of a target whose every MLP is
routed experts, the rotary of a target with one rotary per layer type, and the input / output conventions of the
Gemma families (embeddings scaled by sqrt(hidden) inside the model, soft-capped logits), which a z-lab drafter
states in its own config (`input_embedding_scale`, `final_logit_softcapping`) since it reads the target's RAW
embedding rows and its lm_head's raw logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from blockspec.models.config import ModelConfig

# a dense SwiGLU 3x the hidden size (Qwen3-1.7B's and -8B's ratio) where the target has no dense MLP to copy
MOE_DRAFT_MLP_RATIO = 3


@dataclass(frozen=True)
class DraftTraits:
    intermediate_size: int  # the draft MLP width
    rope: dict[str, Any]  # the drafter's rope_parameters (transformers 5 form, rope_theta inside)
    dflash_extra: dict[str, Any] = field(default_factory=dict)  # dflash_config fields beside the ids and mask


def draft_traits(target: ModelConfig) -> DraftTraits:
    width = target.intermediate_size if target.intermediate_size > 0 else MOE_DRAFT_MLP_RATIO * target.hidden_size
    return DraftTraits(width, _rope(target), _conventions(target))


def _rope(target: ModelConfig) -> dict[str, Any]:
    """The target's rotary, or where it has one per layer type (Gemma 4: `rope_parameters` keyed by layer type),
    plain rotary at its full-attention layers' theta: the drafter attends over the whole context as those do."""
    per_type = target.raw.get("rope_parameters")
    if isinstance(per_type, dict) and isinstance(per_type.get("full_attention"), dict):
        theta = per_type["full_attention"].get("rope_theta", target.rope_theta)
        return {"rope_type": "default", "rope_theta": float(theta)}
    if target.rope_scaling:
        return {**target.rope_scaling, "rope_theta": target.rope_theta}
    return {"rope_type": "default", "rope_theta": target.rope_theta}


def _conventions(target: ModelConfig) -> dict[str, Any]:
    """Gemma targets scale their embeddings by sqrt(hidden) inside the model: the drafter's block embeddings (raw
    rows of the target's table) get the same scale. A target that soft-caps its logits: the drafter's logits are
    capped alike."""
    out: dict[str, Any] = {}
    if target.architecture.startswith("Gemma"):
        out["input_embedding_scale"] = math.sqrt(target.hidden_size)
    cap = target.raw.get("final_logit_softcapping")
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
        out["final_logit_softcapping"] = float(cap)
    return out
