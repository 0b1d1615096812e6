"""How many drafts each step proposes: a draft length policy the scheduler asks once per step (k) and the engine tells
what every verify step accepted (observe).

FixedDraftLen is a {batch: K} schedule as given (or K throughout). LiveDraftLen re-picks K as generation goes: the
calibration's step costs (engine/calibrate.py: ms per step by batch size and K) stay, but what a draft is worth is
measured on the live workload. A schedule derived from a prior acceptance (the drafter's recorded one, or a few shipped
prompts) is right only for prompts like those; on a workload whose drafts are accepted less often it drafts at a loss
(issue 54: K = 1 chosen on the CPU ran at 0.89x plain on new prompts).

The estimate: per batch size measured, the last `window` verify steps (K tried, drafts accepted). Acceptance is a
prefix, so a step of K drafts that accepted n tried positions 1..min(n + 1, K) and passed 1..n: the conditional
acceptance of position i is (passes_i + w c_i) / (tries_i + w), shrunk toward the prior's conditional c_i = p_i /
p_(i-1) with `prior_weight` pseudo-steps (positions not tried lately keep the prior's shape, scaled by the live
positions before them). The worth of K drafts is then 1 + p_1 + ... + p_K tokens a step, its rate that over the step's
cost; K > 0 is chosen only where its rate beats K = 0's by `margin` (a K that only breaks even loses to noise and to
the costs' drift), and a change between two K > 0 needs `hysteresis` (no flapping between near-equal K, each of which
may capture its own CUDA graph). While K = 0 runs nothing is learned: now and then one step drafts the K the estimate
likes best (every `probe_every` steps, or less often where a probe costs several plain steps: PROBE_BUDGET), so a
workload that turns predictable is noticed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field

from blockspec.speculative.schedule import expected_tokens


PROBE_BUDGET = 0.02  # the most the probes at K = 0 may add to the steps' cost


class DraftLenPolicy(ABC):
    """The K of each step (<= the proposer's K) for the batch size it runs."""

    def __init__(self) -> None:
        self.used: Counter[int] = Counter()  # K -> steps scheduled with it (reported: the schedule actually used)

    @abstractmethod
    def k(self, batch: int) -> int:
        """K for the next step of `batch` running requests, without advancing anything (Scheduler.chain asks too)."""

    def next_k(self, batch: int) -> int:
        """K for the step being scheduled now (counted in `used`)."""
        k = self.k(batch)
        self.used[k] += 1
        return k

    def chained(self, k: int) -> None:
        """A step run as the one before it again (the engine's overlap chains decode steps without scheduling)."""
        self.used[k] += 1

    def candidates(self, batch: int) -> list[int]:
        """Every K this policy may schedule at `batch` (what a warm-up captures before a timed run)."""
        return [self.k(batch)]

    def observe(self, batch: int, k: int, num_accepted: int) -> None:
        """A verify step of a request in a batch of `batch`: k drafts verified, num_accepted of them accepted."""


class FixedDraftLen(DraftLenPolicy):
    """A {batch: K} schedule (K of the largest batch <= the running one), or K throughout (schedule None)."""

    def __init__(self, schedule: dict[int, int] | None, max_k: int) -> None:
        super().__init__()
        self.schedule, self.max_k = schedule or None, max_k

    def k(self, batch: int) -> int:
        if not self.schedule:
            return self.max_k
        keys = [b for b in self.schedule if b <= batch]
        return min(self.max_k, self.schedule[max(keys)]) if keys else self.max_k


@dataclass
class _Bucket:
    """One measured batch size's recent verify steps and its current K."""

    k: int
    tries: list[int]  # per draft position: of the steps in the window, those that tried it
    passes: list[int]  # ... and those that accepted it
    steps: deque = field(default_factory=deque)  # (k, num_accepted), the last `window`
    since_probe: int = 0  # steps scheduled at K = 0 since the last probe
    stale: bool = False  # observed since k was picked

    def count(self, k: int, n: int, sign: int) -> None:
        for i in range(min(n + 1, k)):
            self.tries[i] += sign
        for i in range(min(n, k)):
            self.passes[i] += sign


class LiveDraftLen(DraftLenPolicy):
    def __init__(self, step_ms: dict[int, dict[int, float]], prior: list[float], max_k: int,
                 margin: float = 0.1, hysteresis: float = 0.03, window: int = 64, prior_weight: float = 4.0,
                 probe_every: int = 24, probe_budget: float = PROBE_BUDGET) -> None:
        """step_ms: {batch: {K: ms per step}} as the calibration measured it (K = 0 at every batch); prior: p_1..p_K
        the calibration assumed; max_k: the proposer's K (draft lengths above it are never picked)."""
        super().__init__()
        if not step_ms or any(0 not in by_k for by_k in step_ms.values()):
            raise ValueError(f"LiveDraftLen needs the cost of K = 0 at every batch size measured, got {step_ms}")
        self.costs = {b: {k: ms for k, ms in by_k.items() if k <= max_k} for b, by_k in step_ms.items()}
        self.prior = (list(prior) + [0.0] * max_k)[:max_k]
        self.max_k, self.margin, self.hysteresis = max_k, margin, hysteresis
        self.window, self.prior_weight, self.probe_every = window, prior_weight, probe_every
        self.probe_budget = probe_budget
        self.buckets = {b: _Bucket(self._pick(b, self.prior, None), [0] * max_k, [0] * max_k) for b in self.costs}

    def _bucket(self, batch: int) -> int:
        below = [b for b in self.costs if b <= batch]
        return max(below) if below else min(self.costs)

    def per_position(self, batch: int) -> list[float]:
        """p_1..p_K estimated from this batch size's recent verify steps and the prior."""
        bucket = self.buckets[self._bucket(batch)]
        tries, passes = bucket.tries, bucket.passes
        p, out, before = 1.0, [], 1.0
        for i in range(self.max_k):
            c = self.prior[i] / before if before > 0 else 0.0  # the prior's conditional acceptance of position i
            before = self.prior[i]
            p *= (passes[i] + self.prior_weight * min(c, 1.0)) / (tries[i] + self.prior_weight)
            out.append(p)
        return out

    def _rates(self, bucket: int, per_position: list[float]) -> dict[int, float]:
        """Tokens per ms of each K measured at this batch size, at this acceptance."""
        return {k: expected_tokens(per_position, k) / ms for k, ms in self.costs[bucket].items()}

    @staticmethod
    def _best_drafting(rate: dict[int, float]) -> int:
        """The K > 0 with the highest rate (the smaller K on a tie), 0 where none was measured."""
        drafting = [k for k in rate if k > 0]
        return max(drafting, key=lambda k: (rate[k], -k)) if drafting else 0

    def _pick(self, bucket: int, per_position: list[float], current: int | None) -> int:
        rate = self._rates(bucket, per_position)
        best = self._best_drafting(rate)
        if not best or rate[best] < (1.0 + self.margin) * rate[0]:
            return 0
        if current and current in rate and rate[best] <= (1.0 + self.hysteresis) * rate[current]:
            return current
        return best

    def k(self, batch: int) -> int:
        return self._current(batch).k

    def _current(self, batch: int) -> _Bucket:
        """The batch size's bucket, its K re-picked once for all the verify steps observed since the last pick."""
        b = self._bucket(batch)
        bucket = self.buckets[b]
        if bucket.stale:
            bucket.k, bucket.stale = self._pick(b, self.per_position(batch), bucket.k), False
        return bucket

    def next_k(self, batch: int) -> int:
        bucket = self._current(batch)
        k = bucket.k
        if k == 0:
            bucket.since_probe += 1
            if bucket.since_probe >= self.probe_every:  # the earliest a probe may come: is one due?
                probe = self.probe_k(batch)
                if probe and bucket.since_probe >= self._probe_interval(batch, probe):  # does drafting pay again?
                    bucket.since_probe = 0
                    k = probe
        self.used[k] += 1
        return k

    def _probe_interval(self, batch: int, k: int) -> float:
        """Steps at K = 0 between two probes of K: at least probe_every, and enough that the probes' extra cost stays
        under probe_budget of the steps' (a probe at batch 32 on a CPU costs ~3 plain steps: every 24th step would
        add 8 %); never where K would not pay even if every draft were accepted."""
        costs = self.costs[self._bucket(batch)]
        if (1 + k) / costs[k] < (1.0 + self.margin) / costs[0]:
            return float("inf")
        return max(self.probe_every, (costs[k] / costs[0] - 1.0) / self.probe_budget)

    def candidates(self, batch: int) -> list[int]:
        return sorted(self.costs[self._bucket(batch)])

    def probe_k(self, batch: int) -> int:
        """The K > 0 the estimate rates best at this batch size (what a probe step drafts)."""
        return self._best_drafting(self._rates(self._bucket(batch), self.per_position(batch)))

    def observe(self, batch: int, k: int, num_accepted: int) -> None:
        if k <= 0:
            return
        b = self._bucket(batch)
        bucket = self.buckets[b]
        k = min(k, self.max_k)
        bucket.steps.append((k, num_accepted))
        bucket.count(k, num_accepted, 1)
        if len(bucket.steps) > self.window:
            bucket.count(*bucket.steps.popleft(), -1)
        bucket.stale = True
