"""Offline throughput of the batched engine, speculative vs plain (`blockspec bench`, eval-draft), and the timing
protocol both share.

Each timed run is one `generate` of the whole prompt set on an engine warmed up first, untimed, on stand-ins of the
same shapes: every prompt with its first token replaced by one that starts no timed prompt (same lengths and text,
prefilled next to decoding requests as in the timed run; the prefix cache chains block hashes from the first token, so
no block of a stand-in or of its answer can be a hit for a timed prompt, which would change the timed work), then every
decode batch bucket and scheduled draft length the timed run can reach. Kernel compilation and autotuning, first-use
allocation and CUDA graph capture happen there, for each mode. The runs alternate (plain, spec, spec, plain, ...), so
neither mode always comes first, and each mode reports the median of its runs and their spread."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from blockspec.config import EngineConfig
from blockspec.distributed.worker import ModelSpec
from blockspec.engine.decode_step import buckets
from blockspec.engine.outputs import RequestOutput
from blockspec.evaluation.compile_watch import kernel_compiles
from blockspec.errors import BlockspecError
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams
from blockspec.speculative.proposer import Proposer

MODES = ("plain", "spec")
WARM_STEPS = 2  # decode steps each warm-up request runs past its prefill
Params = SamplingParams | list[SamplingParams]


def synthetic_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def run_order(first: str, repeats: int, speculative: bool = True) -> list[str]:
    """`repeats` runs of each mode, alternating which leads: first, other, other, first, first, other, ... (only the
    plain runs when not `speculative`)."""
    if first not in MODES:
        raise BlockspecError(f"--first must be one of {', '.join(MODES)}, got {first!r}")
    if repeats < 1:
        raise BlockspecError(f"--repeats must be >= 1, got {repeats}")
    a, b = first, next(m for m in MODES if m != first)
    order = [m for i in range(repeats) for m in ((a, b) if i % 2 == 0 else (b, a))]
    return order if speculative else [m for m in order if m == "plain"]


def stand_ins(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """`prompts` with their first token replaced by the lowest id that starts none of them: the same shapes, and no
    KV block (of the prompt or of what follows it) in common with any of `prompts`."""
    lead = min(set(range(vocab)) - {p[0] for p in prompts})
    return [[lead, *p[1:]] for p in prompts]


def warm_batch_sizes(config: EngineConfig, num_prompts: int) -> list[int]:
    """Decode batch sizes that reach every bucket a run of `num_prompts` requests can use (the engine captures a
    graph per bucket and K), and every draft length of the schedule up to there."""
    cap = min(config.max_num_seqs, num_prompts)
    keys = [k for k in config.draft_len_schedule or {} if k <= cap]
    return sorted({b for b in buckets(config.max_num_seqs) if b < cap} | {cap} | set(keys))


def warm_up(llm: LLM, prompts: list[list[int]], params: Params, speculate: bool = True) -> None:
    """Untimed: the one-time costs of the run `llm.generate(prompts, params)` would pay, paid on stand-ins."""
    engine = llm.engine
    vocab, K = llm.lm.config.vocab_size, engine.K if speculate else 0
    template = params if isinstance(params, SamplingParams) else params[0]  # same sampling mode, same graphs
    short = replace(template, max_tokens=min(template.max_tokens, 1 + WARM_STEPS * (K + 1)), ignore_eos=True)
    warm = stand_ins(prompts, vocab)
    llm.generate(warm, short, use_tqdm=False, speculate=speculate)
    for n in warm_batch_sizes(engine.config, len(prompts)):  # n short requests decode together: the bucket of n
        sweep = [[warm[0][0], *p] for p in synthetic_prompts(vocab, n, 3, seed=n)]  # the stand-ins' first token
        llm.generate(sweep, short, use_tqdm=False, speculate=speculate)


def timed_generate(llm: LLM, prompts: list[list[int]], params: Params, use_tqdm: bool,
                   speculate: bool = True) -> tuple[list[RequestOutput], float, list[str]]:
    """warm_up, then generate; returns the outputs, the wall time of the generate alone and the Triton kernels that
    compiled inside it (none, when the warm-up did its job)."""
    warm_up(llm, prompts, params, speculate)
    gc.collect()  # the warm-up's garbage is not collected inside the timing
    with kernel_compiles() as compiled:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm, speculate=speculate)
        dt = time.perf_counter() - t0
    return outs, dt, compiled


@dataclass
class ModeRuns:
    """The timed runs of one mode: the outputs of its first run (every run decodes the same requests the same way)
    and each run's generated tokens, wall time and Triton kernels compiled inside it, in run order."""

    outputs: list[RequestOutput]
    tokens: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    compiles: list[list[str]] = field(default_factory=list)
    draft_len_schedule: dict[int, int] | None = None  # the spec engine's {batch: K}; None: K throughout (or plain)
    # spec: per run, K -> steps scheduled with it on that engine (warm-up included): the draft lengths actually used
    draft_lens_used: list[dict[int, int]] = field(default_factory=list)

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens[0] / self.time_s

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median of the run times: 0 for one run."""
        return (max(self.times_s) - min(self.times_s)) / self.time_s

    def runs_tokens_per_second(self) -> list[float]:
        return [n / t for n, t in zip(self.tokens, self.times_s)]


def release() -> None:
    """Free a dropped engine before the next one is built: its CUDA graph pool may sit in reference cycles."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def interleaved(engine: Callable[[str], LLM], prompts: list[list[int]], params: Params, order: list[str],
                use_tqdm: bool = False) -> dict[str, ModeRuns]:
    """Time `prompts` once per entry of `order` (modes), each on engine(mode) warmed up first."""
    runs: dict[str, ModeRuns] = {}
    for mode in order:
        llm = engine(mode)
        policy = llm.engine.draft_len
        outs, dt, compiled = timed_generate(llm, prompts, params, use_tqdm, speculate=mode == "spec")
        schedule = llm.engine.config.draft_len_schedule if mode == "spec" else None
        used = dict(policy.used) if mode == "spec" and llm.engine.proposer is not None else None
        del llm
        release()
        r = runs.setdefault(mode, ModeRuns(outs, draft_len_schedule=schedule))
        if used is not None:
            r.draft_lens_used.append(used)
        r.tokens.append(sum(len(o.token_ids) for o in outs))
        r.times_s.append(dt)
        r.compiles.append(compiled)
    return runs


def speedup_range(spec: ModeRuns, plain: ModeRuns) -> list[float]:
    """[slowest spec run / fastest plain run, fastest spec run / slowest plain run] in tokens/s."""
    s, p = spec.runs_tokens_per_second(), plain.runs_tokens_per_second()
    return [min(s) / max(p), max(s) / min(p)]


@dataclass
class BenchResult:
    mode: str  # "spec" | "plain"
    num_requests: int
    generated_tokens: int
    time_s: float  # median over the runs
    tokens_per_second: float  # generated_tokens / time_s
    mean_acceptance_length: float | None
    runs_time_s: list[float]  # every run, in run order
    time_spread: float  # (slowest - fastest) / median run time
    runs_kernel_compiles: list[list[str]]  # Triton kernels compiled inside each run (warm-up misses), in run order
    draft_len_schedule: dict[int, int] | None  # spec: the draft length per batch size it ran with (None: K throughout)
    draft_lens_used: list[dict[int, int]]  # spec: per run, K -> steps (the live draft length policy's choices)


def result(mode: str, r: ModeRuns) -> BenchResult:
    lens = [a for o in r.outputs for a in o.acceptance_lengths]
    return BenchResult(mode, len(r.outputs), r.tokens[0], r.time_s, r.tokens_per_second,
                       sum(lens) / len(lens) if lens else None, r.times_s, r.spread, r.compiles, r.draft_len_schedule,
                       r.draft_lens_used)


def report(runs: dict[str, ModeRuns], order: list[str]) -> dict:
    """The `blockspec bench` report: each mode's figures, the speedup (of the medians, and its range over the runs),
    whether the outputs are identical, and the order the runs ran in."""
    plain = runs["plain"]
    out: dict = {"plain": result("plain", plain).__dict__, "timing": {"order": order}}
    if "spec" in runs:
        spec = runs["spec"]
        out.update(spec=result("spec", spec).__dict__, speedup=spec.tokens_per_second / plain.tokens_per_second,
                   speedup_range=speedup_range(spec, plain),
                   outputs_identical=[o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs])
    return out


def bench(lm: LoadedModel, draft: Proposer | LoadedDraft | None, prompts: list[list[int]], params: SamplingParams,
          repeats: int = 2, first: str = "plain", engine: EngineConfig | None = None,
          sources: ModelSpec | None = None) -> dict:
    """Plain (and with `draft` speculative) throughput, `repeats` runs each. On one device each run gets engines of
    its own; an engine served by tensor-parallel ranks (engine.tensor_parallel_size > 1; `sources`: where the ranks
    read the models) is started once and times every run, with its prefix cache off (a repeated run's prefill would
    be a cache hit), which the report's "prompts" notes."""
    engine = engine or EngineConfig()
    order = run_order(first, repeats, draft is not None)
    if engine.tensor_parallel_size == 1:
        runs = interleaved(lambda mode: LLM.from_loaded(lm, draft if mode == "spec" else None, engine=engine),
                           prompts, params, order)
        return report(runs, order)
    shared = LLM.from_loaded(lm, draft, engine=replace(engine, enable_prefix_caching=False), sources=sources)
    try:
        runs = interleaved(lambda mode: shared, prompts, params, order)
    finally:
        shared.close()
    return {**report(runs, order), "prompts": {"prefix_caching": False},
            "tensor_parallel_size": engine.tensor_parallel_size}
