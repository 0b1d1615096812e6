"""StageTimes: a StepObserver (blockspec/engine/observer.py) that sums the wall time and calls of every stage of the
engine's steps, and with gaps=True records CUDA events around each decode-step run, for the GPU's idle time between
consecutive runs (what the host's work costs the device)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.observer import StepObserver

T = TypeVar("T")


class StageTimes(StepObserver):
    def __init__(self, gaps: bool = False) -> None:
        self.totals: dict[str, float] = {}  # stage -> seconds, and stage + "_calls" -> count
        self.gaps = gaps
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t
            self.totals[name + "_calls"] = self.totals.get(name + "_calls", 0) + 1

    def replay(self, run: Callable[[], T]) -> T:
        self.totals["decode_runs"] = self.totals.get("decode_runs", 0) + 1
        if not self.gaps:
            return run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run()
        end.record()
        self.marks.append((start, end))
        return out

    def host_gaps_ms(self) -> list[float]:
        """Idle time of the GPU between consecutive recorded runs (waits for the last one)."""
        if not self.marks:
            return []
        self.marks[-1][1].synchronize()
        return [end.elapsed_time(start) for (_, end), (start, _) in zip(self.marks, self.marks[1:])]


def observe(engine: LLMEngine, gaps: bool = False) -> StageTimes:
    times = StageTimes(gaps)
    engine.observe(times)
    return times
