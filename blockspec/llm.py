"""LLM: the offline facade. LLM(model, load=LoadConfig(...), speculative=..., engine=EngineConfig(...))
.generate(prompts, sampling_params).

Built in two steps, which the commands also take one at a time: load_models (the platform plan, loading/platform.py,
then the target and its proposer as the plan says) and the engine (distributed/factory.make_engine: one device, with
the draft length calibration, or tensor-parallel ranks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence as Seq

import torch
from tqdm import tqdm

from blockspec.config import EngineConfig, SpeculativeConfig, default_draft_len_schedule
from blockspec.distributed.factory import make_engine
from blockspec.distributed.worker import ModelSpec
from blockspec.engine.outputs import RequestOutput
from blockspec.errors import BlockspecError
from blockspec.loading import platform
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.load_config import LoadConfig
from blockspec.loading.loader import LoadedModel, load_model
from blockspec.loading.platform import PlatformPlan
from blockspec.loading.quant_default import with_cpu_quant_default
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.draft_len import FixedDraftLen
from blockspec.speculative.proposer import Proposer
from blockspec.speculative.registry import load_proposer


@dataclass
class Models:
    """A target and its proposer, loaded as the engine that runs them needs them (under tensor parallelism rank 0's
    full copies on the CPU, sharded when the engine starts), and where they were read from (the other ranks read
    them again)."""

    lm: LoadedModel
    draft: Proposer | LoadedDraft | None
    sources: ModelSpec

    @property
    def plan(self) -> PlatformPlan:
        """What runs them (loading/platform.py), the drafter included."""
        return self.lm.plan.with_proposer(self.draft)

    @property
    def num_draft_tokens(self) -> int:
        """K, the drafts a step verifies at most (0 without a proposer)."""
        if self.draft is None:
            return 0
        return self.draft.spec.num_draft_tokens if isinstance(self.draft, LoadedDraft) else self.draft.num_draft_tokens


def load_models(model: str | None = None, load: LoadConfig | None = None,
                speculative: SpeculativeConfig | dict | None = None, tensor_parallel_size: int = 1) -> Models:
    """The target at `model` (None: the bundled default) and the proposer `speculative` asks for, loaded in the
    variants the platform plan chooses, with its drafting defaults for the options left unset (on the CPU a DFlash
    drafter drafts full blocks, in bf16 where the CPU has bf16 units). What cannot run is refused before any weight
    is read."""
    load = with_cpu_quant_default(load or LoadConfig(), model, tensor_parallel_size)
    plan = platform.plan(load, speculative, tensor_parallel_size=tensor_parallel_size)
    sources = ModelSpec(model, load, plan.speculative)
    if tensor_parallel_size > 1:
        lm, draft = sources.load_models(with_tokenizer=load.with_tokenizer)
        lm.plan = plan  # what the ranks run (on the device asked), not the CPU this copy waits on
        return Models(lm, draft, sources)
    lm = load_model(model, load, plan)
    draft = load_proposer(plan.speculative, lm) if plan.speculative is not None else None
    return Models(lm, draft, sources)


class LLM:
    def __init__(self, model: str | None = None, *, load: LoadConfig | None = None,
                 speculative: SpeculativeConfig | dict | None = None, engine: EngineConfig | None = None) -> None:
        """model: an HF directory, .gguf file or hub id (None: the bundled default). load: where and how the target
        runs (LoadConfig: device, dtype, cpu_packed, cpu_quant, batch_invariant). speculative: the drafter (a
        SpeculativeConfig or its fields as a dict; None: plain decoding). engine: the batched engine
        (EngineConfig); its draft_len_schedule None is read as "auto" here (K per batch size from the costs measured
        on this machine and the acceptance measured as it runs: engine/calibrate.py, speculative/draft_len.py), or
        as "off" where speculative names num_draft_tokens (an explicit K means K)."""
        engine = engine or EngineConfig()
        if engine.draft_len_schedule is None:
            k = speculative.get("num_draft_tokens") if isinstance(speculative, dict) else getattr(
                speculative, "num_draft_tokens", None)
            engine = replace(engine, draft_len_schedule=default_draft_len_schedule(k))
        models = load_models(model, load, speculative, engine.tensor_parallel_size)
        self._start(models.lm, models.draft, engine, None, models.sources)

    @classmethod
    def from_loaded(cls, lm: LoadedModel, draft: Proposer | LoadedDraft | None = None,
                    acceptance: AcceptancePolicy | None = None, engine: EngineConfig | None = None,
                    sources: ModelSpec | None = None) -> LLM:
        """Wrap an already loaded target (and draft) without reading any files again. acceptance: see LLMEngine
        (benchmarks force one; users keep the default). engine: as given (draft_len_schedule None: the drafter's
        table for this device, else K throughout). sources: where they were read from (load_models(...).sources),
        needed by tensor parallelism only, whose ranks read them again."""
        self = cls.__new__(cls)
        self._start(lm, draft, engine or EngineConfig(), acceptance, sources)
        return self

    def _start(self, lm: LoadedModel, draft: Proposer | LoadedDraft | None, config: EngineConfig,
               acceptance: AcceptancePolicy | None, sources: ModelSpec | None) -> None:
        built = make_engine(lm, draft, config, acceptance, sources)
        self.lm, self.engine, self.calibration, self._session = built.lm, built.engine, built.calibration, built.session
        self.tokenizer = self.lm.tokenizer
        # what runs (loading/platform.py), the drafter included: the commands' stderr line, generate --explain
        self.plan: PlatformPlan = lm.plan.with_proposer(draft)

    def warm_up(self, prompt_ids: list[int], params: SamplingParams) -> float:
        """On CUDA, the one-time costs a request like this one would pay inside its decode, paid now: the CUDA graph
        of every draft length the engine may run at batch 1 is captured and the kernels of this prompt length are
        compiled, on a stand-in prompt of the same length (no prefix-cache hit for the real one) with the draft
        length policy set aside (it learns nothing from the stand-in). Returns the seconds it took; 0 on the CPU,
        which has nothing to capture."""
        if next(self.lm.model.parameters()).device.type != "cuda":
            return 0.0
        engine, t0 = self.engine, time.perf_counter()
        policy, schedule = engine.draft_len, engine.config.draft_len_schedule
        vocab = self.lm.config.vocab_size
        stand_in = [(t + 1) % vocab for t in prompt_ids]
        try:
            for k in policy.candidates(1) if engine.proposer is not None else [0]:
                engine.set_draft_len_policy(FixedDraftLen({1: k}, engine.K), schedule)
                short = replace(params, max_tokens=min(params.max_tokens, 2 + 3 * (k + 1)), ignore_eos=True)
                self.generate([stand_in], short, use_tqdm=False)
        finally:
            engine.set_draft_len_policy(policy, schedule)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the tensor-parallel ranks (a no-op on one device; also done at exit)."""
        if self._session is not None:
            self._session.close()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BlockspecError("this model has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _add_all(self, prompts: Seq[str | list[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None,
                 speculate: bool = True) -> list[str]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise BlockspecError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        return [self.engine.add_request(self._prompt_ids(p), sp, speculate=speculate)
                for p, sp in zip(prompts, sampling_params)]

    def stream(self, prompts: Seq[str | list[int]], sampling_params=None, speculate: bool = True) -> Iterator[RequestOutput]:
        """Yields RequestOutput deltas as the engine steps, until every request is finished: each output carries
        what is new since its request's previous one (new_token_ids, new_acceptance_lengths, new_steps); a request's
        finished output also its whole record (token_ids, acceptance_lengths, steps). Accumulate the deltas: a
        streamed output's token_ids copies the record so far at every read."""
        self._add_all(prompts, sampling_params, speculate)
        while self.engine.has_unfinished():
            yield from self.engine.step()

    def generate(self, prompts: Seq[str | list[int]] | str, sampling_params=None, use_tqdm: bool = True,
                 speculate: bool = True) -> list[RequestOutput]:
        """speculate=False decodes these requests without drafting (plain rows), even with a drafter loaded."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = self._add_all(prompts, sampling_params, speculate)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2, unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]

    def decode(self, out: RequestOutput) -> str | None:
        return self.tokenizer.decode(out.token_ids) if self.tokenizer is not None else None
