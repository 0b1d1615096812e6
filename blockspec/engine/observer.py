"""StepObserver: hooks around the stages of an engine step, for measuring them from outside (benchmarks/step.py).

The engine and its runner call `stage(name)` around each stage they run (schedule, launch, fill, varlen, chain,
collect, commit, outputs) and `replay(run)` around each run of the decode step; the default observer does nothing.
Times measured inside include whatever the stage waits for (collect waits for the device)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, TypeVar

T = TypeVar("T")


class StepObserver:
    def stage(self, name: str) -> ContextManager:
        return nullcontext()

    def replay(self, run: Callable[[], T]) -> T:
        return run()
