"""StepObserver: hooks around the stages of an engine step, for measuring them from outside (benchmarks/step.py).

The engine and its runner call `stage(name)` around each stage they run (schedule, launch, fill, varlen, chain,
collect, commit, outputs), `replay(run)` around each run of the decode step, and `path(...)` when a step path takes
requests (tests check which path ran); the default observer does nothing. Times measured inside include whatever
the stage waits for (collect waits for the device)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager, TypeVar

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq

T = TypeVar("T")


class StepObserver:
    def stage(self, name: str) -> ContextManager:
        return nullcontext()

    def replay(self, run: Callable[[], T]) -> T:
        return run()

    def path(self, name: str, scheduled: list[ScheduledSeq]) -> None:
        """A step path takes these requests: "decode" (launched from the host, or chained: then the requests and
        their (k, next_k) are the step's before) or "varlen". Inside the launch stage, or the chain stage for a
        chained decode step; a mixed step split between the paths reports both."""
