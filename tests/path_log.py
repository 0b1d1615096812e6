"""PathLog: a StepObserver (engine/observer.py) that records which step path took which requests, engine step by
engine step: how the tests check that the decode step, the varlen step or both (a split mixed step) really ran."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

from blockspec.engine.observer import StepObserver
from blockspec.engine.scheduler import ScheduledSeq


class PathLog(StepObserver):
    def __init__(self) -> None:
        # per step launched (from the host, or chained under overlap): (path, requests, K) of each path it took;
        # K is 0 on the varlen path, whose requests may verify different numbers of drafts
        self.steps: list[list[tuple[str, int, int]]] = []
        self.requests: list[tuple[str, list[ScheduledSeq]]] = []  # (path, the requests it took), in order

    def stage(self, name: str) -> ContextManager:
        if name in ("launch", "chain"):
            self.steps.append([])
        return nullcontext()

    def path(self, name: str, scheduled: list[ScheduledSeq]) -> None:
        self.steps[-1].append((name, len(scheduled), scheduled[0].k if name == "decode" else 0))
        self.requests.append((name, scheduled))

    @property
    def calls(self) -> list[tuple[str, int, int]]:
        return [c for s in self.steps for c in s]
