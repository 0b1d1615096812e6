"""Offline throughput of the batched engine, speculative vs plain, from one run (`blockspec bench`, eval-draft)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from blockspec.engine.outputs import RequestOutput
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.speculative.proposer import Proposer
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams


@dataclass
class BenchResult:
    mode: str  # "spec" | "plain"
    num_requests: int
    generated_tokens: int
    time_s: float
    tokens_per_second: float
    mean_acceptance_length: float | None


def synthetic_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


WARMUP_TOKENS = 8


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   use_tqdm: bool, speculate: bool = True) -> tuple[list[RequestOutput], float]:
    """Generate after a short warm-up on the same engine (kernel compilation and CUDA graph capture happen there,
    not in the timed run); returns the outputs and the wall time of the timed run."""
    warm = [p[:WARMUP_TOKENS] for p in prompts[: llm.engine.config.max_num_seqs]]
    llm.generate(warm, SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True), use_tqdm=False, speculate=speculate)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm, speculate=speculate)
    return outs, time.perf_counter() - t0


Measured = tuple[BenchResult, list[list[int]]]  # the figures and every request's tokens


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, speculate: bool = True) -> Measured:
    outs, dt = timed_generate(llm, prompts, params, use_tqdm=False, speculate=speculate)
    n = sum(len(o.token_ids) for o in outs)
    lens = [a for o in outs for a in o.acceptance_lengths]
    tau = sum(lens) / len(lens) if lens else None
    mode = "spec" if speculate and llm.engine.proposer is not None else "plain"
    return BenchResult(mode, len(prompts), n, dt, n / dt, tau), [o.token_ids for o in outs]


def report(plain: Measured, spec: Measured | None) -> dict:
    """The `blockspec bench` report: both runs, the speedup, and whether the outputs are identical."""
    out: dict = {"plain": plain[0].__dict__}
    if spec is not None:
        out.update(spec=spec[0].__dict__, speedup=spec[0].tokens_per_second / plain[0].tokens_per_second,
                   outputs_identical=spec[1] == plain[1])
    return out


def bench(lm: LoadedModel, draft: Proposer | LoadedDraft | None, prompts: list[list[int]], max_tokens: int,
          **engine_config) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = measure(LLM.from_loaded(lm, None, **engine_config), prompts, params)
    spec = measure(LLM.from_loaded(lm, draft, **engine_config), prompts, params) if draft is not None else None
    return report(plain, spec)
