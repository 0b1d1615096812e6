"""Measure a drafter on prompts: acceptance (tau, per position, histogram) and speed against plain decoding through the
batched engine, timed as evaluation/throughput.py times (warmed engines, alternating runs, medians)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from blockspec.config import OFF, EngineConfig
from blockspec.evaluation.throughput import interleaved, run_order, speedup_range
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
    time_s: float  # median over the spec runs
    tokens_per_second: float  # generated_tokens / time_s
    baseline_generated_tokens: int
    baseline_time_s: float  # median over the plain runs
    baseline_tokens_per_second: float
    speedup: float  # tokens_per_second / baseline_tokens_per_second
    outputs_identical: bool | None  # spec output == plain output for every prompt (None when sampling)
    # greedy only: {"prompt": i, "first_divergence": token index} of each prompt whose outputs differ (in bf16 a
    # near-tie token can flip between verify rows and decode rows; in fp32 this list is empty)
    differing_outputs: list[dict[str, int]] | None = None
    # [num_prompts] tau of each prompt in input order (where a drafter is weak: e.g. MT-Bench per category); None
    # for a prompt that had no verify step
    per_prompt_acceptance: list[float | None] | None = None
    # the timing (evaluation/throughput.py): the modes in the order their runs ran, each run's wall time in that
    # order, (slowest - fastest) / median per mode, and the speedup's range over the runs
    timing_order: list[str] | None = None
    runs_time_s: list[float] | None = None
    baseline_runs_time_s: list[float] | None = None
    time_spread: float | None = None
    baseline_time_spread: float | None = None
    speedup_range: list[float] | None = None
    # Triton kernels compiled inside each timed run (a warm-up miss: ~1 s of compiling counted as decoding)
    runs_kernel_compiles: list[list[str]] | None = None
    baseline_runs_kernel_compiles: list[list[str]] | None = None


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


def eval_engine(prompts: list[list[int]], max_tokens: int, k: int, max_num_seqs: int) -> EngineConfig:
    """Engine settings of an evaluation run with K drafts (0: plain only): room for every running request's prompt,
    response and verify window, so nothing is preempted mid-measurement; and K drafts in every step, whatever the
    batch: a drafter's recorded draft-length table for this device (speculative/schedule.py) would mix steps of
    other K, plain steps included, into the acceptance it reports as the drafter's at K (an H100 run of the bundled
    drafter read tau 3.18 instead of 4.03 on HumanEval, fp32, the same outputs)."""
    per_request = max(map(len, prompts)) + max_tokens + k + 1 + EngineConfig.block_size  # + page rounding
    return EngineConfig(max_num_seqs=max_num_seqs, kv_cache_tokens=min(max_num_seqs, len(prompts)) * per_request,
                        max_num_batched_tokens=max(1024, 2 * max_num_seqs * (k + 1)), draft_len_schedule=OFF)


def evaluate_draft(lm: LoadedModel, draft: Proposer | LoadedDraft, prompts: list[list[int]], params: SamplingParams,
                   dataset: str, max_num_seqs: int = 1, use_tqdm: bool = True, repeats: int = 2,
                   first: str = "plain") -> DraftEvalReport:
    """Run `prompts` (token ids) through the engine without speculation and with `draft` (any proposer, or a loaded
    DFlash drafter), same settings, `repeats` times each, alternating which mode runs first (`first` leads). When
    sampling, prompt i uses seed params.seed + i in every run."""
    draft = as_proposer(draft)
    k = draft.num_draft_tokens
    engine = eval_engine(prompts, params.max_tokens, k, max_num_seqs)
    per_prompt = params if params.greedy else [replace(params, seed=(params.seed or 0) + i)
                                               for i in range(len(prompts))]
    order = run_order(first, repeats)
    runs = interleaved(lambda mode: LLM.from_loaded(lm, draft if mode == "spec" else None, engine=engine), prompts,
                       per_prompt, order, use_tqdm)
    spec_runs, plain_runs = runs["spec"], runs["plain"]
    spec, plain = spec_runs.outputs, plain_runs.outputs
    stats = acceptance_stats(spec, k)
    hist = [0] * (k + 1)
    for n in stats.acceptance_lengths:
        hist[n - 1] += 1
    tps, base_tps = spec_runs.tokens_per_second, plain_runs.tokens_per_second
    differ = divergences([o.token_ids for o in spec], [o.token_ids for o in plain]) if params.greedy else None
    return DraftEvalReport(
        dataset=dataset, num_prompts=len(prompts), num_draft_tokens=k,
        mean_acceptance_length=stats.mean_acceptance_length, per_position_acceptance=stats.per_position_acceptance(),
        acceptance_histogram=hist, num_verify_steps=len(stats.acceptance_lengths),
        generated_tokens=spec_runs.tokens[0], time_s=spec_runs.time_s, tokens_per_second=tps,
        baseline_generated_tokens=plain_runs.tokens[0], baseline_time_s=plain_runs.time_s,
        baseline_tokens_per_second=base_tps, speedup=tps / base_tps,
        outputs_identical=not differ if differ is not None else None, differing_outputs=differ,
        per_prompt_acceptance=[round(sum(a) / len(a), 4) if (a := o.acceptance_lengths) else None for o in spec],
        timing_order=order, runs_time_s=spec_runs.times_s, baseline_runs_time_s=plain_runs.times_s,
        time_spread=spec_runs.spread, baseline_time_spread=plain_runs.spread,
        speedup_range=speedup_range(spec_runs, plain_runs), runs_kernel_compiles=spec_runs.compiles,
        baseline_runs_kernel_compiles=plain_runs.compiles,
    )
