"""Runs one engine step on the models: verify -> sample -> accept -> append context -> propose, on one of two paths
over the same stages (blockspec/speculative/step.py) and the same host layout (engine/step_layout.py), same results:

- the decode step (engine/decode_step.py), when every scheduled request decodes with the same (K, K'): one
  static-shape function, replayed from a CUDA graph on GPU; with split_mixed a mixed step runs its decoding
  requests there and only the rest varlen;
- the varlen step (engine/varlen_step.py), for any mix of prefill chunks and verify blocks: one target forward over
  every scheduled row, then sampling, acceptance, the proposer's context append and the next drafts on the device,
  and one device-to-host copy.

Either way the step returns, per request, the tokens committed and the next drafts (speculative/drafts.py): the
engine commits them and never asks which path ran. launch() hands a step to the device and collect() reads it;
a decode step can be continued on the device (launch_next) before it is read (overlap, engine/llm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import EngineConfig
from blockspec.engine.decode_step import DecodeStep, Launched
from blockspec.engine.observer import StepObserver
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence, StepResult
from blockspec.engine.status import CapturedGraph
from blockspec.engine.varlen_step import varlen_step
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.proposer import StepModels


@dataclass
class Pending:
    """A step handed to the device: a decode step still running (`launched`), or the results of one that has run."""

    seqs: list[Sequence]
    launched: Launched | None = None
    results: list[StepResult] | None = None

    @property
    def chain_k(self) -> int | None:
        """K when the step can be continued on the device with the same K (launch_next), else None."""
        L = self.launched
        return L.K if L is not None and L.K == L.next_k else None


class ModelRunner:
    def __init__(self, models: StepModels, acceptance: AcceptancePolicy, max_model_len: int, vocab_size: int,
                 config: EngineConfig) -> None:
        self.models, self.acceptance, self.vocab_size, self.max_model_len = models, acceptance, vocab_size, max_model_len
        self.device = models.pool.k.device
        self.split_mixed = config.split_mixed_steps
        self.decode_path = config.step_path != "varlen"  # "varlen": every step on the varlen path (tests)
        capture = self.device.type == "cuda" and models.backend.capturable and not config.enforce_eager
        self.decode = DecodeStep(models, acceptance, config.max_num_seqs, max_model_len, vocab_size, capture)
        self.observer = StepObserver()
        self.num_decode_steps = self.num_varlen_steps = 0

    def observe(self, observer: StepObserver) -> None:
        self.observer = self.decode.observer = observer

    def captured_graphs(self) -> list[CapturedGraph]:
        return [CapturedGraph(*key[:3], all_greedy=key[3]) for key in self.decode.graphs]

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq]) -> Pending:
        """Hand the step to the device: the decode step is enqueued without waiting for it; any other step runs."""
        seqs = [s.seq for s in scheduled]
        if self.decode_path and self.decode.eligible(scheduled):
            return Pending(seqs, launched=self._decode(scheduled))
        decoding, rest = self.decode.split(scheduled) if self.split_mixed and self.decode_path else ([], scheduled)
        by_seq = {id(r.seq): r for r in self.decode.collect(self._decode(decoding))} if decoding else {}
        if rest:
            with self.observer.stage("varlen"):
                self.num_varlen_steps += 1
                self.observer.path("varlen", rest)
                by_seq.update((id(r.seq), r) for r in self.varlen_step(rest))
        return Pending(seqs, results=[by_seq[id(s)] for s in seqs])

    def _decode(self, scheduled: list[ScheduledSeq]) -> Launched:
        self.num_decode_steps += 1
        self.observer.path("decode", scheduled)
        return self.decode.launch(scheduled)

    @torch.inference_mode()
    def launch_next(self, prev: Pending) -> Pending:
        """The next step of prev's requests, enqueued behind it on the device (prev.chain_k is not None)."""
        self.num_decode_steps += 1
        self.observer.path("decode", prev.launched.layout.scheduled)
        return Pending(prev.seqs, launched=self.decode.launch_next(prev.launched))

    def collect(self, pending: Pending) -> list[StepResult]:
        return pending.results if pending.launched is None else self.decode.collect(pending.launched)

    def step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        return self.collect(self.launch(scheduled))

    def varlen_step(self, scheduled: list[ScheduledSeq]) -> list[StepResult]:
        return varlen_step(self.models, self.acceptance, scheduled, self.vocab_size, self.device)
