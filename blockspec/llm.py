"""LLM: the offline facade. LLM(model, speculative_config=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Iterator, Sequence as Seq

from tqdm import tqdm

from blockspec.config import AUTO, EngineConfig, SpeculativeConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.outputs import RequestOutput
from blockspec.errors import BlockspecError, ConfigError
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.proposer import Proposer
from blockspec.speculative.registry import load_proposer, method_of


class LLM:
    def __init__(self, model: str | None = None, speculative_config: SpeculativeConfig | dict | None = None,
                 device: str | None = None, dtype: str | None = None, cpu_packed: bool = False,
                 batch_invariant: bool = False, cpu_quant: str = "off", **engine_config) -> None:
        """cpu_packed: on the CPU, the target's linears packed once for oneDNN (faster steps, same dtype; see
        layers/cpu_packed.py). batch_invariant: on the GPU, the target computed the same way whatever the batch
        (layers/invariant_linear.py): greedy speculative output equals plain decoding in bf16 too. cpu_quant:
        auto | q8 | q4 | off, on the CPU the target's linears on packed int8 / int4 weights (layers/cpu_quant.py)."""
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig(**speculative_config)
        # a user who turns speculation on never gets a slower engine: K per batch size measured on this machine
        config = EngineConfig(**{"draft_len_schedule": AUTO, **engine_config})
        self.tp, self.calibration = None, None
        if config.tensor_parallel_size > 1:  # this process becomes rank 0 of N (docs/tensor-parallel.md)
            if cpu_packed:
                raise ConfigError("cpu_packed=True is not supported with tensor_parallel_size > 1 (packed linears "
                                  "cannot be sharded)")
            if cpu_quant != "off":
                raise ConfigError(f"cpu_quant={cpu_quant!r} is not supported with tensor_parallel_size > 1 "
                                  f"(quantized linears cannot be sharded)", field="cpu_quant")
            if batch_invariant:
                raise ConfigError("batch_invariant=True is not supported with tensor_parallel_size > 1 (the sharded "
                                  "linears and all-reduces are not batch-invariant)")
            if speculative_config is not None and method_of(speculative_config) != "dflash":
                raise ConfigError(f"speculative method {method_of(speculative_config)!r} is not supported with "
                                  f"tensor_parallel_size > 1 (only 'dflash' drafters are sharded)", field="method")
            if speculative_config is not None and speculative_config.cpu_bf16_draft:
                raise ConfigError("cpu_bf16_draft=True is not supported with tensor_parallel_size > 1 (the packed "
                                  "bf16 drafter cannot be sharded)")
            from blockspec.distributed.launch import TensorParallelSession
            from blockspec.distributed.worker import ModelSpec

            # the ranks mirror rank 0's runner calls: a calibration would run every one of them; the drafter's table
            # for this device (if any) or K throughout
            if config.draft_len_schedule == AUTO:
                config = replace(config, draft_len_schedule=None)
            self.tp = TensorParallelSession(ModelSpec(model, speculative_config, device, dtype), config)
            self.lm, self.engine = self.tp.lm, self.tp.engine
            self.tokenizer = self.lm.tokenizer
            return
        self.lm = load_model(model, LoadConfig(device=device, dtype=dtype, cpu_packed=cpu_packed,
                                               batch_invariant=batch_invariant, cpu_quant=cpu_quant))
        self.tokenizer = self.lm.tokenizer
        proposer = load_proposer(speculative_config, self.lm) if speculative_config is not None else None
        self.engine = LLMEngine(self.lm, proposer, config)
        self._calibrate(config)

    @classmethod
    def from_loaded(cls, lm: LoadedModel, draft: Proposer | LoadedDraft | None = None,
                    acceptance: AcceptancePolicy | None = None, **engine_config) -> LLM:
        """Wrap an already loaded target (and draft) without reading any files again. acceptance: see LLMEngine
        (benchmarks force one; users keep the default)."""
        self = cls.__new__(cls)
        self.lm, self.tokenizer, self.tp, self.calibration = lm, lm.tokenizer, None, None
        config = EngineConfig(**engine_config)
        self.engine = LLMEngine(lm, draft, config, acceptance)
        self._calibrate(config)
        return self

    def _calibrate(self, config: EngineConfig) -> None:
        """draft_len_schedule="auto": the draft length per batch size for this machine (engine/calibrate.py), kept
        in self.calibration for callers to report."""
        if config.draft_len_schedule == AUTO and self.engine.proposer is not None:
            from blockspec.engine.calibrate import auto_schedule

            self.calibration = auto_schedule(self.engine)
            if self.calibration.drafts_nothing:
                # no draft length pays at any batch size on this machine: the plain engine, since a drafter kept at
                # K = 0 still appends its context every step (~5 % of a q4 CPU step, measured) for nothing
                self.engine = None
                gc.collect()  # the speculative engine's KV pool goes before the plain one is allocated
                self.engine = LLMEngine(self.lm, None, config)
            else:
                self.engine.set_draft_len_schedule(self.calibration.schedule)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (a no-op on one device; also done at exit)."""
        if self.tp is not None:
            self.tp.close()

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
