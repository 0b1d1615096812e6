"""Server metrics, written by the engine thread and the HTTP handlers, exposed through prometheus_client.

Each app has its own CollectorRegistry (several apps may live in one process, e.g. in tests); the metrics' own locks
make them safe to update from both threads.

A choice's tokens and verify steps are counted as its usage counts them: a stop string ends the choice at the token
that completed it, and what the engine generated past that (the rest of that step, and the steps run before the
abort reached the engine) is counted apart, as discarded tokens."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from blockspec.engine.outputs import FinishReason, RequestOutput, StepTrace

TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format generate_latest writes


class _WithoutCreated(Collector):
    """The metrics minus the `_created` series prometheus_client adds to counters and histograms: the exposed series
    stay the ones blockspec always had, without flipping the library's process-wide switch."""

    def __init__(self, metrics: list[MetricWrapperBase]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for metric in self.metrics:
            for family in metric.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


class Metrics:
    def __init__(self, num_draft_tokens: int, kv_blocks_total: int) -> None:
        made: list[MetricWrapperBase] = []  # registered below, through the filter

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            made.append(Counter(name, doc, labels, registry=None))  # exposed as `name`: it ends in "_total"
            return made[-1]

        def gauge(name: str, doc: str) -> Gauge:
            made.append(Gauge(name, doc, registry=None))
            return made[-1]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            made.append(Histogram(name, doc, buckets=buckets, registry=None))
            return made[-1]

        self.http = counter("blockspec_requests_total", "HTTP responses by endpoint and status code.",
                            ("endpoint", "status"))
        self.finished = counter("blockspec_finished_requests_total",
                                "Choices finished, by the finish reason answered (abort: the client left or the "
                                "request failed).", ("finish_reason",))
        self.errors = counter("blockspec_errors_total", "Internal errors: one request failed, or an engine step.",
                              ("kind",))
        self.prompt_tokens = counter("blockspec_prompt_tokens_total", "Prompt tokens of finished engine requests.")
        self.generation_tokens = counter("blockspec_generation_tokens_total",
                                         "Tokens generated, up to the stop string of a choice that ended on one.")
        self.discarded_tokens = counter("blockspec_discarded_tokens_total",
                                        "Tokens generated past the stop string of a choice that ended on one.")
        self.verify_steps = counter("blockspec_verify_steps_total",
                                    "Verify steps of finished speculative choices, up to a stop string's.")
        self.proposed = counter("blockspec_draft_proposed_total", "Draft tokens proposed at each block position.",
                                ("position",))
        self.accepted = counter("blockspec_draft_accepted_total", "Draft tokens accepted at each block position.",
                                ("position",))
        self.draft_lens = counter("blockspec_draft_len_steps_total",
                                  "Engine steps scheduled with each draft length K (the draft length policy's "
                                  "choices; K = 0: no drafts).", ("draft_len",))
        self._draft_lens_seen: dict[int, int] = {}
        self.waiting = gauge("blockspec_requests_waiting", "Engine requests waiting to be scheduled.")
        self.running = gauge("blockspec_requests_running", "Engine requests running.")
        self.kv_used = gauge("blockspec_kv_blocks_used", "KV pool blocks held by requests.")
        self.kv_total = gauge("blockspec_kv_blocks_total", "KV pool blocks.")
        self.kv_usage = gauge("blockspec_kv_usage_ratio", "Fraction of KV pool blocks held by requests.")
        self.tau = histogram("blockspec_request_mean_acceptance_length",
                             "tau (mean tokens per verify step) of each finished speculative request.", TAU_BUCKETS)
        self.step_latency = histogram("blockspec_step_latency_seconds", "Wall time of one engine step.",
                                      LATENCY_BUCKETS)
        for i in range(num_draft_tokens):  # every position is exposed from the start, at 0
            self.proposed.labels(position=str(i + 1))
            self.accepted.labels(position=str(i + 1))
        self.kv_total.set(kv_blocks_total)
        self._kv_blocks_total = kv_blocks_total
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated(made))

    def count_http(self, path: str, status: int) -> None:
        self.http.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()

    def count_error(self, kind: str) -> None:
        """kind: "request" (one request failed) or "step" (an engine step raised)."""
        self.errors.labels(kind=kind).inc()

    def record_step(self, seconds: float, waiting: int, running: int, kv_used: int) -> None:
        self.step_latency.observe(seconds)
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_usage.set(kv_used / self._kv_blocks_total)

    def record_draft_lens(self, used: dict[int, int]) -> None:
        """The engine's draft length policy's counts so far (K -> steps): what is new since the last call."""
        for k, n in used.items():
            new = n - self._draft_lens_seen.get(k, 0)
            if new > 0:
                self.draft_lens.labels(draft_len=str(k)).inc(new)
                self._draft_lens_seen[k] = n

    def count_finish(self, reason: FinishReason) -> None:
        """One choice ended with `reason`, as answered to the client (a stop string is "stop" although its engine
        request was aborted)."""
        self.finished.labels(finish_reason=reason.value).inc()

    def record_output(self, out: RequestOutput) -> None:
        """An engine output as it is: no stop string cut it (nobody read it, or it was read whole)."""
        self.count_tokens(len(out.new_token_ids))
        if out.finished:
            self.record_finished(len(out.prompt_ids), out.acceptance_lengths, out.steps or [])

    def count_tokens(self, generated: int, discarded: int = 0) -> None:
        self.generation_tokens.inc(generated)
        self.discarded_tokens.inc(discarded)

    def record_finished(self, prompt_len: int, acceptance_lengths: list[int], steps: list[StepTrace]) -> None:
        """One choice's engine request is over; `acceptance_lengths` and `steps` are the verify steps counted (for
        a stop string: up to the step that completed it)."""
        self.prompt_tokens.inc(prompt_len)
        if acceptance_lengths:
            self.tau.observe(sum(acceptance_lengths) / len(acceptance_lengths))
            self.verify_steps.inc(len(acceptance_lengths))
        for step in steps:
            for i in range(len(step.draft)):
                self.proposed.labels(position=str(i + 1)).inc()
                if i < step.num_accepted:
                    self.accepted.labels(position=str(i + 1)).inc()

    def value(self, name: str, **labels: str) -> float:
        """One exposed sample, e.g. value("blockspec_errors_total", kind="step"); 0 where none was counted yet."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
