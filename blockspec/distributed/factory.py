"""The engine an LLM runs, built in one place whatever serves it: on one device, the engine, then the draft length
calibration (engine/calibrate.py), which may build it again without the drafter when no draft length pays; under
tensor parallelism (EngineConfig.tensor_parallel_size > 1), rank 0's engine over the ranks it spawns
(launch.TensorParallelSession). LLM and the commands call make_engine and never branch on tensor_parallel_size.

The calibration is part of the build rather than a later step on a live engine: the caller gets the engine it will
run, and nothing swaps it afterwards (an engine kept with its drafter at K = 0 would still append the drafter's
context every step: ~5 % of a q4 CPU step, measured)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

from blockspec.config import AUTO, EngineConfig
from blockspec.distributed import launch
from blockspec.distributed.worker import ModelSpec
from blockspec.engine.calibrate import Calibration, auto_schedule
from blockspec.engine.llm_engine import LLMEngine
from blockspec.errors import ConfigError
from blockspec.loading.capabilities import sharding_refusal
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.proposer import Proposer


@dataclass
class BuiltEngine:
    """What make_engine built: the engine, the models it runs (rank 0's shards under tensor parallelism), the
    calibration that set its draft length schedule (None: none ran) and the tensor-parallel ranks (None: one
    device; close() stops them)."""

    engine: LLMEngine
    lm: LoadedModel
    calibration: Calibration | None = None
    session: launch.TensorParallelSession | None = None


def make_engine(lm: LoadedModel, draft: Proposer | LoadedDraft | None, config: EngineConfig,
                acceptance: AcceptancePolicy | None = None, sources: ModelSpec | None = None) -> BuiltEngine:
    """The engine for `lm` and `draft` as `config` says. sources: where the models were read from, which the
    tensor-parallel ranks read again (lm and draft are then rank 0's full copies, on the CPU, sharded here)."""
    if config.tensor_parallel_size > 1:
        if callable(getattr(lm.model, "recurrent_shape", None)):  # before any rank shards its layers
            raise ConfigError("tensor parallelism does not support hybrid targets (linear-attention layers) yet",
                              field="tensor_parallel_size")
        why = sharding_refusal(lm.model)  # layers shard.py does not split (gpt-oss's sinks, Gemma 4's own layers)
        if why is not None:
            raise ConfigError(why, field="tensor_parallel_size")
        if sources is None:
            raise ConfigError("tensor_parallel_size > 1 needs the models' sources, which every rank reads: build the "
                              "LLM with LLM(model, ...) or LLM.from_loaded(..., sources=load_models(...).sources)",
                              field="tensor_parallel_size")
        if config.draft_len_schedule == AUTO:
            # the ranks mirror rank 0's runner calls: a calibration would run every one of them; the drafter's table
            # for this device (if any) or K throughout
            config = replace(config, draft_len_schedule=None)
        session = launch.TensorParallelSession(sources, config, lm, draft)  # type: ignore[arg-type]
        return BuiltEngine(session.engine, session.lm, None, session)
    engine = LLMEngine(lm, draft, config, acceptance)
    if config.draft_len_schedule != AUTO or engine.proposer is None:
        return BuiltEngine(engine, lm)
    calibration = auto_schedule(engine)
    if not calibration.drafts_nothing:
        engine.set_draft_len_policy(calibration.policy(engine.K), calibration.schedule)
        return BuiltEngine(engine, lm, calibration)
    # no draft length pays at any batch size on this machine: the plain engine, since a drafter kept at K = 0 still
    # appends its context every step for nothing
    del engine
    gc.collect()  # the speculative engine's KV pool goes before the plain one is allocated
    return BuiltEngine(LLMEngine(lm, None, config, acceptance), lm, calibration)
