"""Rank 0's side: spawn the other ranks, shard its own copy, run the engine, broadcast each runner call.

The user's process is rank 0; ranks 1..N-1 are spawned with torch.multiprocessing (start method "spawn", so a
script that builds a tensor-parallel LLM needs the usual `if __name__ == "__main__":` guard)."""

from __future__ import annotations

import atexit
import dataclasses
import queue
import time

import torch.multiprocessing as mp

from blockspec.config import EngineConfig
from blockspec.distributed.parallel_state import TPGroup, destroy_tp, free_port, init_tp
from blockspec.distributed.shard import check_tp_size, shard_pair
from blockspec.distributed.worker import ModelSpec, StepMessage, broadcast, portable, worker_main
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.model_runner import ModelRunner, Pending
from blockspec.engine.observer import StepObserver
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import StepResult
from blockspec.errors import BlockspecError
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel, resolve_device


class BroadcastingRunner:
    """Stands in for rank 0's ModelRunner inside LLMEngine: tells the other ranks what to run, then runs it. (Overlap
    is off under tensor parallelism: every step is launched and collected before the next.)"""

    def __init__(self, runner: ModelRunner, tp: TPGroup) -> None:
        self.runner, self.tp = runner, tp

    def launch(self, scheduled: list[ScheduledSeq]) -> Pending:
        broadcast(self.tp, StepMessage("step", scheduled=[dataclasses.replace(s, seq=portable(s.seq))
                                                          for s in scheduled]))
        return self.runner.launch(scheduled)

    def collect(self, pending: Pending) -> list[StepResult]:
        return self.runner.collect(pending)

    def observe(self, observer: StepObserver) -> None:
        self.runner.observe(observer)


def _wait_ready(procs: list, ready, deadline_s: float = 3600.0) -> None:
    """Every spawned rank must report that it loaded its models; a failure or a dead rank is raised here."""
    pending, t0 = {p.name for p in procs}, time.monotonic()
    while pending:
        try:
            rank, error = ready.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.name in pending and not p.is_alive()]
            if dead or time.monotonic() - t0 > deadline_s:
                raise BlockspecError(f"tensor-parallel rank process {(dead or procs)[0].name} died or hung while "
                                     f"loading the models") from None
            continue
        if error is not None:
            raise BlockspecError(f"tensor-parallel rank {rank} failed to load the models:\n{error}")
        pending.discard(f"blockspec-tp-rank{rank}")


class TensorParallelSession:
    """N ranks serving one LLMEngine (`engine`, on rank 0, which shards `lm` and `draft`: its full copies on the
    CPU, read as `spec` says, as every other rank reads them). close() stops the ranks; also run at exit."""

    def __init__(self, spec: ModelSpec, config: EngineConfig, lm: LoadedModel, draft: LoadedDraft | None) -> None:
        n = config.tensor_parallel_size
        check_tp_size(n, lm.config, f"target ({lm.source.path})")
        if draft is not None:
            check_tp_size(n, draft.config, f"draft ({spec.speculative.draft_model})")
        port, ctx = free_port(), mp.get_context("spawn")
        ready = ctx.Queue()
        self.procs = [ctx.Process(target=worker_main, args=(r, n, port, spec, config, ready), daemon=True,
                                  name=f"blockspec-tp-rank{r}") for r in range(1, n)]
        for p in self.procs:
            p.start()
        try:
            _wait_ready(self.procs, ready)
        except BlockspecError:
            for p in self.procs:  # the others are loading or waiting for rank 0: nothing to finish
                p.terminate()
            self._stop_procs()
            raise
        self.tp = init_tp(0, n, port, resolve_device(spec.load.device))
        lm, draft = shard_pair(lm, draft, self.tp)
        self.lm = lm
        self.engine = LLMEngine(lm, draft, config, wrap_runner=lambda runner: BroadcastingRunner(runner, self.tp))
        atexit.register(self.close)

    def _stop_procs(self) -> None:
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.procs = []

    def close(self) -> None:
        if not self.procs:
            return
        broadcast(self.tp, StepMessage("stop"))
        destroy_tp()  # together with the workers, which leave their serve loop on "stop"
        self._stop_procs()
        atexit.unregister(self.close)
