"""Counters and histograms of one batcher: always on, so cheap per request (its cost is
measured in docs/benchmarks.md, with ``telemetry=False`` to compare).

Histograms keep cumulative buckets (for Prometheus-style export) and a ring of the most
recent samples (for exact percentiles). :meth:`Telemetry.snapshot` turns everything into
frozen, typed values; exporters (Prometheus, a person's view) read only those.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.core.request import Batch, Outcome, Request, RequestState, RequestTrace, trace_of

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
RING_SIZE = 8192  # a power of two: the ring index is masked, not divided
SLOWEST_WINDOW_S = 10.0  # how long the slowest request answered stays the one shown
# Every reason ``ClassStats.rejections`` may count: exporters show each from 0, since a
# counter series that first appears at 1 is invisible to Prometheus' rate().
REJECTION_REASONS: tuple[str, ...] = ("cancelled", "closed", "deadline", "invalid", "queue_full")

slow_log = logging.getLogger("carpool.slow")

TraceHook = Callable[[RequestTrace], None]
MemoryProbe = Callable[[], tuple[int, int]]  # (used_bytes, total_bytes), after each batch


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Seconds; percentiles over the most recent ``RING_SIZE`` samples."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    p999_s: float
    max_s: float
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count), +inf last
    # The running total itself: ``mean_s * count`` recomputed at each snapshot can come
    # out a few ulps lower than before, and a Prometheus ``_sum`` that goes down is a reset.
    sum_s: float = 0.0


class Histogram:
    __slots__ = ("_pos", "_ring", "bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0
        self._ring = [0.0] * RING_SIZE
        self._pos = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value
        self._ring[self._pos & (RING_SIZE - 1)] = value
        self._pos += 1

    def recent(self) -> list[float]:
        """The most recent samples (at most ``RING_SIZE``), in no particular order."""
        return self._ring[: min(self._pos, RING_SIZE)]

    @staticmethod
    def merged(histograms: list[Histogram], *, quantiles: bool = True) -> LatencyStats:
        """Stats over several histograms with the same bounds, as if they were one; with
        ``quantiles`` false, their recent samples are neither gathered nor sorted."""
        total = Histogram(histograms[0].bounds if histograms else LATENCY_BUCKETS_S)
        for h in histograms:
            total.counts = [a + b for a, b in zip(total.counts, h.counts, strict=True)]
            total.count += h.count
            total.total += h.total
        if not quantiles:
            return total.stats(quantiles=False)
        return total.stats([v for h in histograms for v in h.recent()])

    def stats(self, samples: list[float] | None = None, *, quantiles: bool = True) -> LatencyStats:
        """Counts, buckets and sum; with ``quantiles`` also the percentiles and max of the
        recent samples (a sort of up to ``RING_SIZE`` values), else those are NaN."""
        if not quantiles:
            samples = []
        recent = sorted(self.recent() if samples is None else samples)
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return LatencyStats(
            count=self.count,
            mean_s=self.total / self.count if self.count else math.nan,
            p50_s=_quantile(recent, 0.50),
            p90_s=_quantile(recent, 0.90),
            p99_s=_quantile(recent, 0.99),
            p999_s=_quantile(recent, 0.999),
            max_s=recent[-1] if recent else math.nan,
            buckets=tuple(cumulative),
            sum_s=self.total,
        )


def _balance(fractions: list[float]) -> float:
    highest = max(fractions, default=0.0)
    return min(fractions) / highest if highest > 0 else 1.0


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class ClassStats:
    """One priority class. ``slo_attainment``: answered within ``slo_s`` / (answered + expired)."""

    name: str
    num_requests: int
    num_items: int
    num_completed: int
    num_failed: int
    num_pending: int
    num_batches_led: int
    rejections: dict[str, int]
    latency: LatencyStats
    queue_wait: LatencyStats
    slo_s: float | None
    slo_attainment: float | None


@dataclass(frozen=True, slots=True)
class BatchStats:
    """``fill_ratio``: the mean over batches of batch size / the max batch size it was
    formed under. ``effective_compute_ratio``: compute time / (compute time + time
    replicas idled holding a batch open to fill)."""

    num_batches: int
    num_items: int
    mean_batch_size: float
    size_histogram: dict[int, int]
    size_compute_s: dict[int, float]  # compute seconds summed per batch size
    fill_ratio: float
    effective_compute_ratio: float
    compute: LatencyStats
    num_tokens: int = 0  # variable-length items only: real tokens batched
    num_padded_slots: int = 0  # slots the model computed on padding
    padding_waste: float = 0.0  # padded slots / all slots
    # Model calls that succeeded (a batch split after a failure runs as several), and the
    # items of their requests (Triton's execution_count and inference_count); when the
    # last of them landed.
    num_completed_batches: int = 0
    num_completed_items: int = 0
    last_completed_unix_s: float | None = None
    # Those calls by the size each ran, and their compute seconds (Triton's batch_stats).
    completed_size_histogram: dict[int, int] = field(default_factory=dict)
    completed_size_compute_s: dict[int, float] = field(default_factory=dict)
    # Each successful request's model call, its seconds summed (Triton's compute_infer).
    completed_compute_s: float = 0.0
    # Each successful request's arrival to its model call's start, summed (Triton's
    # queue: a closed batch's wait for a busy replica included).
    completed_queue_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: int
    device: str
    num_batches: int
    num_items: int
    busy_s: float
    fill_wait_s: float
    busy_fraction: float
    num_abandoned: int = 0  # threads given up after a batch ran past batch_timeout_s
    num_stuck_threads: int = 0  # of those, the ones whose call has not returned yet
    num_restarts: int = 0  # replica processes started again after they died or hung


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """From the runner's memory probe: ``volatility`` = (peak - trough) / total."""

    num_samples: int
    peak_bytes: int
    trough_bytes: int
    total_bytes: int
    volatility: float


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    """Everything a batcher measured, at one moment."""

    model: str
    uptime_s: float
    num_pending: int
    classes: dict[str, ClassStats]
    batches: BatchStats
    replicas: tuple[ReplicaStats, ...]
    replica_balance: float  # min busy / max busy; 1.0 is perfectly even
    memory: MemoryStats | None
    latency: LatencyStats
    # Refused from their head (every queue full) before their body, and so their class,
    # was read: counted for the model, in no class.
    num_refused_from_head: int = 0
    # The slowest request answered in the last SLOWEST_WINDOW_S or so: where a p99's time
    # went (carpool top and the dashboard show it).
    slowest: RequestTrace | None = None


class _ClassCounters:
    __slots__ = (
        "batches_led",
        "completed",
        "failed",
        "items",
        "latency",
        "queue_wait",
        "rejections",
        "requests",
        "slo_met",
        "slo_total",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests = 0
        self.items = 0
        self.completed = 0
        self.failed = 0
        self.batches_led = 0
        self.rejections: Counter[str] = Counter()
        self.latency = Histogram()
        self.queue_wait = Histogram()
        self.slo_met = 0
        self.slo_total = 0


_NO_COUNTERS = _ClassCounters()  # answered_ok's before its first request


class ReplicaCounters:
    __slots__ = (
        "batches",
        "busy_s",
        "device",
        "fill_wait_s",
        "items",
        "num_abandoned",
        "num_restarts",
        "num_stuck_threads",
        "replica_id",
    )

    def __init__(self, replica_id: int, device: str) -> None:
        self.replica_id = replica_id
        self.device = device
        self.batches = 0
        self.items = 0
        self.busy_s = 0.0
        self.fill_wait_s = 0.0
        self.num_abandoned = 0
        self.num_stuck_threads = 0  # refreshed when a snapshot is taken
        self.num_restarts = 0  # a process replica's, after it died or hung


class Telemetry:
    """Collects what one batcher does. Methods are called from the event loop only."""

    def __init__(
        self,
        model: str,
        slo_by_class: dict[str, float | None],
        *,
        on_trace: TraceHook | None = None,
        slow_request_s: float | None = None,
    ) -> None:
        self.model = model
        self.on_trace = on_trace
        self.slow_request_s = slow_request_s
        self._slo = dict(slo_by_class)
        self._classes = {name: _ClassCounters() for name in slo_by_class}
        self._sizes: Counter[int] = Counter()
        self._size_compute: defaultdict[int, float] = defaultdict(float)
        self._num_batches = 0
        self._num_items = 0
        self._num_refused_from_head = 0
        self._ok_batches = 0
        self._ok_items = 0
        self._ok_sizes: Counter[int] = Counter()
        self._ok_size_compute: defaultdict[int, float] = defaultdict(float)
        self._ok_compute_s = 0.0
        self._ok_queue_s = 0.0
        self._last_ok_unix_s: float | None = None
        self._fill_sum = 0.0
        self._num_tokens = 0
        self._num_slots = 0
        self._slowest: RequestTrace | None = None
        self._slowest_s = 0.0
        self._slowest_since_s = -math.inf
        self._compute = Histogram()
        self._mem: list[int] = []  # [num, peak, trough, total]

    def set_classes(self, slo_by_class: dict[str, float | None]) -> None:
        self._slo = dict(slo_by_class)
        for name in slo_by_class:
            self._classes.setdefault(name, _ClassCounters())

    def admitted(self, request: Request) -> None:
        counters = self._classes[request.class_name]
        counters.requests += 1
        counters.items += request.num_items

    def rejected(self, class_name: str, reason: str, num: int = 1) -> None:
        counters = self._classes.get(class_name)
        if counters is not None:
            counters.rejections[reason] += num

    def refused_from_head(self) -> None:
        """A request refused before its class was known (:meth:`Batcher.refuse_early`)."""
        self._num_refused_from_head += 1

    def batch_done(self, batch: Batch, replica: ReplicaCounters, compute_s: float) -> None:
        # Requests whose call came past their deadline, or after their callers cancelled
        # them, never reached the model (settle.py): the batch ran without them, or, when
        # they were all of it, did not run at all.
        num_items = batch.num_items - sum(
            r.num_items for r in batch.requests if r.state >= RequestState.EXPIRED
        )
        if num_items == 0:
            return
        self._num_batches += 1
        self._num_items += num_items
        self._sizes[num_items] += 1
        self._size_compute[num_items] += compute_s
        self._fill_sum += num_items / batch.max_batch_size
        self._compute.observe(compute_s)
        self._classes[batch.lead_class].batches_led += 1
        replica.batches += 1
        replica.items += num_items
        replica.busy_s += compute_s

    def tokens(self, num_tokens: int, num_slots: int) -> None:
        """A batch of variable-length items: its real tokens and the slots computed."""
        self._num_tokens += num_tokens
        self._num_slots += num_slots

    def answered(self, request: Request, outcome: Outcome, now: float) -> None:
        if outcome is Outcome.OK:
            self.answered_ok([request], now)
            return
        counters = self._classes[request.class_name]
        total_s = now - request.arrival_s
        if outcome is Outcome.EXPIRED:
            counters.rejections["deadline"] += 1
        elif outcome is Outcome.CANCELLED:
            counters.rejections["cancelled"] += 1
        elif outcome is Outcome.CLOSED:
            counters.rejections["closed"] += 1
        else:
            counters.failed += 1
        slo = self._slo.get(request.class_name)
        if slo is not None and outcome is Outcome.EXPIRED:
            counters.slo_total += 1
        if self.on_trace is not None or (
            self.slow_request_s is not None and total_s > self.slow_request_s
        ):
            self._report(trace_of(request, outcome, now), total_s)

    def answered_ok(self, requests: list[Request], now: float) -> None:
        """:meth:`answered` with ``Outcome.OK`` for each of ``requests`` in turn: those
        one model call answered, counted as one execution of their size (Triton's
        ``batch_stats``). A batch split after a failure runs as several calls, and each
        call that succeeded counts at the size it ran. One call a batch, on the event loop."""
        if not requests:
            return
        first = requests[0]
        call_s = first.compute_end_s - first.compute_start_s
        num_items = 0
        queue_s = 0.0
        # A class's counters and SLO looked up once per run of requests of that class.
        classes, slos = self._classes, self._slo
        name: str | None = None
        counters = _NO_COUNTERS
        slo: float | None = None
        for request in requests:
            if request.class_name != name:
                name = request.class_name
                counters, slo = classes[name], slos.get(name)
            total_s = now - request.arrival_s
            counters.completed += 1
            num_items += request.num_items
            counters.latency.observe(total_s)
            counters.queue_wait.observe(request.batch_closed_s - request.arrival_s)
            queue_s += request.compute_start_s - request.arrival_s
            if slo is not None:
                counters.slo_total += 1
                counters.slo_met += total_s <= slo
            if total_s > self._slowest_s or now - self._slowest_since_s > SLOWEST_WINDOW_S:
                self._keep_slowest(request, now, total_s)
            if self.on_trace is not None or (
                self.slow_request_s is not None and total_s > self.slow_request_s
            ):
                self._report(trace_of(request, Outcome.OK, now), total_s)
                # A hook may have set new classes: looked up again.
                classes, slos, name = self._classes, self._slo, None
        self._ok_batches += 1
        self._ok_items += num_items
        self._ok_compute_s += call_s * len(requests)  # as Triton: each request's call
        self._ok_queue_s += queue_s
        self._ok_sizes[num_items] += 1
        self._ok_size_compute[num_items] += call_s
        self._last_ok_unix_s = time.time()

    def _keep_slowest(self, request: Request, now: float, total_s: float) -> None:
        """Keep ``request`` as the slowest: a slower one replaces it, and once it is older
        than SLOWEST_WINDOW_S the next one answered starts a new window."""
        if now - self._slowest_since_s > SLOWEST_WINDOW_S:
            self._slowest_since_s = now
        self._slowest = trace_of(request, Outcome.OK, now)
        self._slowest_s = total_s

    def _report(self, trace: RequestTrace, total_s: float) -> None:
        if self.slow_request_s is not None and total_s > self.slow_request_s:
            slow_log.warning("slow request (%s): %s", self.model, trace.describe())
        if self.on_trace is not None:
            self.on_trace(trace)

    def memory(self, used_bytes: int, total_bytes: int) -> None:
        if not self._mem:
            self._mem = [1, used_bytes, used_bytes, total_bytes]
            return
        mem = self._mem
        mem[0] += 1
        mem[1] = max(mem[1], used_bytes)
        mem[2] = min(mem[2], used_bytes)
        mem[3] = total_bytes

    def snapshot(
        self,
        uptime_s: float,
        pending_by_class: dict[str, int],
        replicas: list[ReplicaCounters],
        *,
        quantiles: bool = True,
    ) -> TelemetrySnapshot:
        classes = {
            name: self._class_stats(name, c, pending_by_class.get(name, 0), quantiles)
            for name, c in self._classes.items()
        }
        busy = sum(r.busy_s for r in replicas)
        fill_wait = sum(r.fill_wait_s for r in replicas)
        fractions = [r.busy_s / uptime_s if uptime_s > 0 else 0.0 for r in replicas]
        return TelemetrySnapshot(
            model=self.model,
            uptime_s=uptime_s,
            num_pending=sum(pending_by_class.values()),
            num_refused_from_head=self._num_refused_from_head,
            classes=classes,
            batches=BatchStats(
                num_batches=self._num_batches,
                num_items=self._num_items,
                mean_batch_size=self._num_items / self._num_batches if self._num_batches else 0.0,
                size_histogram=dict(sorted(self._sizes.items())),
                size_compute_s=dict(sorted(self._size_compute.items())),
                fill_ratio=self._fill_sum / self._num_batches if self._num_batches else 0.0,
                effective_compute_ratio=busy / (busy + fill_wait) if busy + fill_wait else 0.0,
                compute=self._compute.stats(quantiles=quantiles),
                num_tokens=self._num_tokens,
                num_padded_slots=self._num_slots - self._num_tokens,
                padding_waste=1 - self._num_tokens / self._num_slots if self._num_slots else 0.0,
                num_completed_batches=self._ok_batches,
                num_completed_items=self._ok_items,
                last_completed_unix_s=self._last_ok_unix_s,
                completed_size_histogram=dict(sorted(self._ok_sizes.items())),
                completed_size_compute_s=dict(sorted(self._ok_size_compute.items())),
                completed_compute_s=self._ok_compute_s,
                completed_queue_s=self._ok_queue_s,
            ),
            replicas=tuple(
                ReplicaStats(
                    replica_id=r.replica_id,
                    device=r.device,
                    num_batches=r.batches,
                    num_items=r.items,
                    busy_s=r.busy_s,
                    fill_wait_s=r.fill_wait_s,
                    busy_fraction=f,
                    num_abandoned=r.num_abandoned,
                    num_stuck_threads=r.num_stuck_threads,
                    num_restarts=r.num_restarts,
                )
                for r, f in zip(replicas, fractions, strict=True)
            ),
            replica_balance=_balance(fractions),
            memory=self._memory_stats(),
            latency=Histogram.merged(
                [c.latency for c in self._classes.values()], quantiles=quantiles
            ),
            slowest=self._slowest,
        )

    def _class_stats(
        self, name: str, c: _ClassCounters, pending: int, quantiles: bool
    ) -> ClassStats:
        slo = self._slo.get(name)
        return ClassStats(
            name=name,
            num_requests=c.requests,
            num_items=c.items,
            num_completed=c.completed,
            num_failed=c.failed,
            num_pending=pending,
            num_batches_led=c.batches_led,
            rejections=dict(c.rejections),
            latency=c.latency.stats(quantiles=quantiles),
            queue_wait=c.queue_wait.stats(quantiles=quantiles),
            slo_s=slo,
            slo_attainment=c.slo_met / c.slo_total if slo is not None and c.slo_total else None,
        )

    def _memory_stats(self) -> MemoryStats | None:
        if not self._mem:
            return None
        num, peak, trough, total = self._mem
        return MemoryStats(
            num_samples=num,
            peak_bytes=peak,
            trough_bytes=trough,
            total_bytes=total,
            volatility=(peak - trough) / total if total else 0.0,
        )


class NullTelemetry(Telemetry):
    """Records nothing. Exists only so the benchmark can measure what telemetry costs."""

    def admitted(self, request: Request) -> None:
        pass

    def batch_done(self, batch: Batch, replica: ReplicaCounters, compute_s: float) -> None:
        replica.busy_s += compute_s

    def tokens(self, num_tokens: int, num_slots: int) -> None:
        pass

    def answered(self, request: Request, outcome: Outcome, now: float) -> None:
        pass

    def answered_ok(self, requests: list[Request], now: float) -> None:
        pass


def guarded_hook(hook: TraceHook, name: str) -> TraceHook:
    """``hook`` with its errors logged: a faulty hook must not strand the batch's requests."""

    def call(trace: RequestTrace) -> None:
        try:
            hook(trace)
        except Exception:
            logging.getLogger("carpool").exception("on_trace hook of %r raised", name)

    return call
