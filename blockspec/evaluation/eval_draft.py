"""Measure a drafter on prompts: acceptance (tau, per position, histogram) and speed against plain decoding, from
one run of each through the batched engine."""

from __future__ import annotations

from dataclasses import dataclass, replace

from blockspec.evaluation.throughput import timed_generate
from blockspec.config import EngineConfig
from blockspec.engine.outputs import RequestOutput
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams
from blockspec.speculative.proposer import Proposer
from blockspec.speculative.registry import as_proposer
from blockspec.speculative.stats import SpecStats


@dataclass
class DraftEvalReport:
    dataset: str
    num_prompts: int
    num_draft_tokens: int  # K
    mean_acceptance_length: float | None  # tau over all verify steps of all prompts (tokens emitted per step)
    per_position_acceptance: list[float]  # [K]: fraction of verify steps whose draft i (1..K) was accepted
    acceptance_histogram: list[int]  # [K + 1]: verify steps that emitted 1, 2, ..., K + 1 tokens
    num_verify_steps: int
    generated_tokens: int
    time_s: float
    tokens_per_second: float
    baseline_generated_tokens: int
    baseline_time_s: float
    baseline_tokens_per_second: float
    speedup: float  # tokens_per_second / baseline_tokens_per_second
    outputs_identical: bool | None  # spec output == plain output for every prompt (None when sampling)
    # greedy only: {"prompt": i, "first_divergence": token index} of each prompt whose outputs differ (in bf16 a
    # near-tie token can flip between verify rows and decode rows; in fp32 this list is empty)
    differing_outputs: list[dict[str, int]] | None = None
    # [num_prompts] tau of each prompt in input order (where a drafter is weak: e.g. MT-Bench per category); None
    # for a prompt that had no verify step
    per_prompt_acceptance: list[float | None] | None = None


def divergences(spec: list[list[int]], plain: list[list[int]]) -> list[dict[str, int]]:
    """Where each differing pair of outputs first parts (an index past the shorter one when one is a prefix)."""
    out = []
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            t = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"prompt": i, "first_divergence": t})
    return out


def acceptance_stats(outs: list[RequestOutput], k: int) -> SpecStats:
    """All verify steps of all requests pooled into one SpecStats."""
    stats = SpecStats(k)
    for out in outs:
        stats.acceptance_lengths += out.acceptance_lengths
        stats.num_accepted += [step.num_accepted for step in out.steps or []]
    return stats


def evaluate_draft(lm: LoadedModel, draft: Proposer | LoadedDraft, prompts: list[list[int]], params: SamplingParams,
                   dataset: str, max_num_seqs: int = 1, use_tqdm: bool = True) -> DraftEvalReport:
    """Run `prompts` (token ids) through the engine without speculation, then with `draft` (any proposer, or a
    loaded DFlash drafter), same settings. When sampling, prompt i uses seed params.seed + i in both runs."""
    draft = as_proposer(draft)
    k = draft.num_draft_tokens
    # room for every running request's prompt, response and verify window: nothing is preempted mid-measurement
    per_request = max(map(len, prompts)) + params.max_tokens + k + 1 + EngineConfig.block_size  # + page rounding
    kv = min(max_num_seqs, len(prompts)) * per_request
    engine = dict(max_num_seqs=max_num_seqs, kv_cache_tokens=kv,
                  max_num_batched_tokens=max(1024, 2 * max_num_seqs * (k + 1)))
    per_prompt = params if params.greedy else [replace(params, seed=(params.seed or 0) + i)
                                               for i in range(len(prompts))]
    plain, plain_s = timed_generate(LLM.from_loaded(lm, None, **engine), prompts, per_prompt, use_tqdm)
    spec, spec_s = timed_generate(LLM.from_loaded(lm, draft, **engine), prompts, per_prompt, use_tqdm)
    stats = acceptance_stats(spec, k)
    hist = [0] * (k + 1)
    for n in stats.acceptance_lengths:
        hist[n - 1] += 1
    n_spec, n_plain = sum(len(o.token_ids) for o in spec), sum(len(o.token_ids) for o in plain)
    tps, base_tps = n_spec / spec_s, n_plain / plain_s
    differ = divergences([o.token_ids for o in spec], [o.token_ids for o in plain]) if params.greedy else None
    return DraftEvalReport(
        dataset=dataset, num_prompts=len(prompts), num_draft_tokens=k,
        mean_acceptance_length=stats.mean_acceptance_length, per_position_acceptance=stats.per_position_acceptance(),
        acceptance_histogram=hist, num_verify_steps=len(stats.acceptance_lengths),
        generated_tokens=n_spec, time_s=spec_s, tokens_per_second=tps,
        baseline_generated_tokens=n_plain, baseline_time_s=plain_s, baseline_tokens_per_second=base_tps,
        speedup=tps / base_tps,
        outputs_identical=not differ if differ is not None else None, differing_outputs=differ,
        per_prompt_acceptance=[round(sum(a) / len(a), 4) if (a := o.acceptance_lengths) else None for o in spec],
    )
