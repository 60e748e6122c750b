"""What a generation engine measures: token counters, request and token latencies,
requests by how they ended, forward passes by size; :mod:`carpool.server.metrics` and
:mod:`carpool.server.stats` export its :class:`GenerationSnapshot`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from carpool.core.telemetry import LATENCY_BUCKETS_S, Histogram, LatencyStats
from carpool.generation.request import FinishReason
from carpool.generation.scheduler import SchedulerStats

# A request's own latencies (first token, end to end, queue): generations may run for
# minutes, so the buckets go on past the core's 60 s, as vLLM's do.
REQUEST_LATENCY_BUCKETS_S = (*LATENCY_BUCKETS_S, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Inter-token latencies are short: finer buckets at the low end than request latency.
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """Requests that ended one way, and their seconds summed: ``e2e_s`` from arrival to
    the end, ``queue_s`` from arrival to the first step that scheduled them (0 for one
    never scheduled)."""

    count: int = 0
    e2e_s: float = 0.0
    queue_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Forward passes of one size (sequences in the step) that ran, and their seconds."""

    count: int = 0
    compute_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GenerationSnapshot:
    """Everything measured so far."""

    model: str
    scheduler: SchedulerStats
    num_prompt_tokens: int
    num_generation_tokens: int
    finished: dict[str, int]  # by finish reason (and "error")
    time_to_first_token: LatencyStats
    inter_token_latency: LatencyStats
    e2e_latency: LatencyStats
    queue_time: LatencyStats
    succeeded: RequestTotals  # finished by stop or length
    failed: RequestTotals  # finished by abort (left early, stopped) or error
    last_succeeded_unix_s: float | None  # wall time the last one succeeded
    num_steps: int  # forward passes that ran (their tokens were delivered)
    steps_by_size: dict[int, StepTotals]  # the same, by sequences in the step


@dataclass(slots=True)
class RequestTimes:
    """One request's moments on the engine's clock, and the tokens it was sent."""

    arrival_s: float
    num_prompt_tokens: int
    scheduled_s: float | None = None  # the first step that ran it
    first_token_s: float | None = None
    last_token_s: float = 0.0  # arrival until the first token
    num_generated: int = 0

    def __post_init__(self) -> None:
        self.last_token_s = self.arrival_s


@dataclass(frozen=True, slots=True)
class GenerationTrace:
    """Where one generation request's time went, for a trace hook: seconds on the
    engine's clock, NaN for a moment it never reached; ``steps`` are the (start, end) of
    each forward pass it was in, in order (its prefill first)."""

    request_id: int
    class_name: str
    outcome: str  # its finish reason, or "error"
    num_prompt_tokens: int
    num_generated: int
    arrived_s: float
    scheduled_s: float
    first_token_s: float
    answered_s: float
    steps: tuple[tuple[float, float], ...]


class EngineTelemetry:
    """Token counters and latency histograms (the scheduler keeps the rest)."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.time_to_first_token = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.inter_token_latency = Histogram(TOKEN_LATENCY_BUCKETS_S)
        self.e2e_latency = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.succeeded = RequestTotals()
        self.failed = RequestTotals()
        self.last_succeeded_unix_s: float | None = None
        self.num_steps = 0
        self.steps_by_size: dict[int, StepTotals] = {}

    def step(self, num_seqs: int, compute_s: float) -> None:
        self.num_steps += 1
        totals = self.steps_by_size.get(num_seqs, StepTotals())
        self.steps_by_size[num_seqs] = StepTotals(totals.count + 1, totals.compute_s + compute_s)

    def scheduled(self, times: RequestTimes, now: float) -> None:
        if times.scheduled_s is None:
            times.scheduled_s = now
            self.queue_time.observe(now - times.arrival_s)

    def tokens(self, times: RequestTimes, count: int, now: float) -> None:
        if times.first_token_s is None:
            times.first_token_s = now
            self.time_to_first_token.observe(now - times.arrival_s)
            self.num_prompt_tokens += times.num_prompt_tokens
        else:
            self.inter_token_latency.observe((now - times.last_token_s) / count)
        times.last_token_s = now
        times.num_generated += count
        self.num_generation_tokens += count

    def finished(self, times: RequestTimes, reason: str, now: float) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        e2e_s = now - times.arrival_s
        self.e2e_latency.observe(e2e_s)
        queue_s = 0.0 if times.scheduled_s is None else times.scheduled_s - times.arrival_s
        if reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
            self.succeeded = _add(self.succeeded, e2e_s, queue_s)
            self.last_succeeded_unix_s = time.time()  # once per request: wall time for stats
        else:
            self.failed = _add(self.failed, e2e_s, queue_s)

    def snapshot(
        self, model: str, scheduler: SchedulerStats, quantiles: bool = True
    ) -> GenerationSnapshot:
        return GenerationSnapshot(
            model=model,
            scheduler=scheduler,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            finished=dict(self.finished_by_reason),
            time_to_first_token=self.time_to_first_token.stats(quantiles=quantiles),
            inter_token_latency=self.inter_token_latency.stats(quantiles=quantiles),
            e2e_latency=self.e2e_latency.stats(quantiles=quantiles),
            queue_time=self.queue_time.stats(quantiles=quantiles),
            succeeded=self.succeeded,
            failed=self.failed,
            last_succeeded_unix_s=self.last_succeeded_unix_s,
            num_steps=self.num_steps,
            steps_by_size=dict(self.steps_by_size),
        )


def _add(totals: RequestTotals, e2e_s: float, queue_s: float) -> RequestTotals:
    return RequestTotals(totals.count + 1, totals.e2e_s + e2e_s, totals.queue_s + queue_s)
