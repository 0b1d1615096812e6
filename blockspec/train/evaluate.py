"""Real acceptance length (tau) of the drafter being trained: greedy speculative decoding of held-out prompts with
the batched engine, the way the drafter will be used."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.loading.dflash_options import resolve_spec
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.models.dflash import DFlashDraftModel
from blockspec.sampling import SamplingParams


def inference_draft(lm: LoadedModel, model: DFlashDraftModel, name: str = "(training)") -> LoadedDraft:
    """A LoadedDraft holding a copy of `model` in the target's dtype, as load_draft would build it."""
    dtype = next(lm.model.parameters()).dtype
    frozen = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
    cfg = model.config
    return LoadedDraft(frozen, cfg, resolve_spec(SpeculativeConfig(draft_model=name), cfg, lm.config, name))


def evaluate_tau(lm: LoadedModel, model: DFlashDraftModel, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy generation of every prompt with speculation: mean tokens per verify step over all steps (tau)."""
    from blockspec.llm import LLM

    t0 = time.perf_counter()
    # eager: capturing CUDA graphs for a drafter that lives for one evaluation would cost more than it saves
    llm = LLM.from_loaded(lm, inference_draft(lm, model), engine=EngineConfig(
        max_num_seqs=min(len(prompts), 32), enforce_eager=True,
        max_model_len=max(map(len, prompts)) + max_tokens + model.config.block_size))
    with torch.inference_mode():
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    lengths = [n for o in outs for n in o.acceptance_lengths]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        "tau_per_prompt": [o.mean_acceptance_length for o in outs],
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "time_s": round(time.perf_counter() - t0, 2),
    }
