"""What the server saw during a run: batch statistics from its ``/metrics``, before and after.

Counters and histograms are cumulative since the server started, so the run's own share
is the difference of two scrapes::

    scrape ──── measured run ──── scrape      run's batches = after - before

``carpool_fill_ratio`` and ``carpool_effective_compute_ratio`` are gauges over the whole
uptime: the fill ratio of the run is rebuilt from the run's mean batch size and the max
batch size the lifetime gauge implies; the effective compute ratio is reported as the
server states it (lifetime). An in-process target gives the same numbers from two
:class:`TelemetrySnapshot` values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from carpool.core.telemetry import LatencyStats, TelemetrySnapshot

# One sample: (sample name, sorted label pairs) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A model's batching during one run."""

    model: str
    num_batches: int
    num_items: int
    mean_batch_size: float | None
    fill_ratio: float | None
    effective_compute_ratio: float | None  # the server's lifetime figure
    mean_queue_wait_s: float | None  # per request: arrival to batch close
    mean_compute_s: float | None  # per batch: model time
    batch_size_counts: dict[str, int]  # bucket upper bound ("+Inf" last) -> batches
    rejections: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus exposition text, keyed by name and labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            samples[key] = float(sample.value)
    return samples


def _select(samples: Samples, name: str, model: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        labels: value
        for (sample, labels), value in samples.items()
        if sample == name and ("model", model) in labels
    }


def _total(samples: Samples, name: str, model: str) -> float:
    return sum(_select(samples, name, model).values())


def _delta(before: Samples, after: Samples, name: str, model: str) -> float:
    return _total(after, name, model) - _total(before, name, model)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def stats_from_metrics(before: str, after: str, model: str) -> ServerStats | None:
    """The run's stats for ``model`` from two scrapes; None when the server exposes no
    ``carpool_batch_size`` for it (not a carpool server, or another model name)."""
    old, new = parse_metrics(before), parse_metrics(after)
    if not _select(new, "carpool_batch_size_count", model):
        return None
    num_batches = _delta(old, new, "carpool_batch_size_count", model)
    num_items = _delta(old, new, "carpool_batch_size_sum", model)
    mean = _ratio(num_items, num_batches)
    fill = _window_fill(
        (_total(old, "carpool_fill_ratio", model), _total(old, "carpool_batch_size_count", model)),
        (_total(new, "carpool_fill_ratio", model), _total(new, "carpool_batch_size_count", model)),
    )
    effective = _select(new, "carpool_effective_compute_ratio", model)
    return ServerStats(
        model=model,
        num_batches=round(num_batches),
        num_items=round(num_items),
        mean_batch_size=mean,
        fill_ratio=fill,
        effective_compute_ratio=sum(effective.values()) if effective else None,
        mean_queue_wait_s=_ratio(
            _delta(old, new, "carpool_queue_wait_seconds_sum", model),
            _delta(old, new, "carpool_queue_wait_seconds_count", model),
        ),
        mean_compute_s=_ratio(
            _delta(old, new, "carpool_batch_compute_seconds_sum", model),
            _delta(old, new, "carpool_batch_compute_seconds_count", model),
        ),
        batch_size_counts=_bucket_counts(old, new, model),
        rejections=_rejections(old, new, model),
    )


def _bucket_counts(old: Samples, new: Samples, model: str) -> dict[str, int]:
    """Per-bucket batches of the run: cumulative ``le`` buckets, differenced twice."""
    cumulative: list[tuple[float, str, float]] = []
    for labels, value in _select(new, "carpool_batch_size_bucket", model).items():
        bound = dict(labels)["le"]
        before = old.get(("carpool_batch_size_bucket", labels), 0.0)
        cumulative.append((float(bound), bound, value - before))
    cumulative.sort()
    counts: dict[str, int] = {}
    previous = 0.0
    for _, bound, running in cumulative:
        counts[_bound_label(bound)] = round(running - previous)
        previous = running
    return counts


def _bound_label(bound: str) -> str:
    value = float(bound)
    return "+Inf" if math.isinf(value) else f"{value:g}"


def _rejections(old: Samples, new: Samples, model: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for labels, value in _select(new, "carpool_rejections_total", model).items():
        reason = dict(labels).get("reason", "unknown")
        count = value - old.get(("carpool_rejections_total", labels), 0.0)
        if count:
            out[reason] = out.get(reason, 0) + round(count)
    return out


def stats_from_snapshots(before: TelemetrySnapshot, after: TelemetrySnapshot) -> ServerStats:
    """The same statistics for an in-process batcher, from two telemetry snapshots."""
    b0, b1 = before.batches, after.batches
    num_batches = b1.num_batches - b0.num_batches
    num_items = b1.num_items - b0.num_items
    mean = _ratio(num_items, num_batches)
    fill = _window_fill((b0.fill_ratio, b0.num_batches), (b1.fill_ratio, b1.num_batches))
    sizes = {
        str(size): count - b0.size_histogram.get(size, 0)
        for size, count in sorted(b1.size_histogram.items())
        if count - b0.size_histogram.get(size, 0) > 0
    }
    compute_s = _total_s(b1.compute) - _total_s(b0.compute)
    waits = _queue_wait_sums(before), _queue_wait_sums(after)
    return ServerStats(
        model=after.model,
        num_batches=num_batches,
        num_items=num_items,
        mean_batch_size=mean,
        fill_ratio=fill,
        effective_compute_ratio=b1.effective_compute_ratio,
        mean_queue_wait_s=_ratio(waits[1][0] - waits[0][0], waits[1][1] - waits[0][1]),
        mean_compute_s=_ratio(compute_s, b1.compute.count - b0.compute.count),
        batch_size_counts=sizes,
        rejections=_snapshot_rejections(before, after),
    )


def _window_fill(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The run's mean fill ratio from the lifetime ones (each a mean over batches of size /
    the max batch size *that* batch had) and the batch counts at its start and end: the
    sums of fills differenced. Was: the run's mean size over a max batch size inferred
    from the lifetime figures, wrong (a fill of 2.05) once the policy's size had changed."""
    (fill_0, count_0), (fill_1, count_1) = before, after
    num_batches = count_1 - count_0
    if num_batches <= 0:
        return None
    return (fill_1 * count_1 - fill_0 * count_0) / num_batches


def _total_s(stats: LatencyStats) -> float:
    """Summed seconds of a latency histogram (its mean is NaN while it is empty)."""
    return stats.mean_s * stats.count if stats.count else 0.0


def _queue_wait_sums(snapshot: TelemetrySnapshot) -> tuple[float, int]:
    total_s = sum(_total_s(c.queue_wait) for c in snapshot.classes.values())
    return total_s, sum(c.queue_wait.count for c in snapshot.classes.values())


def _snapshot_rejections(before: TelemetrySnapshot, after: TelemetrySnapshot) -> dict[str, int]:
    def totals(snapshot: TelemetrySnapshot) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for stats in snapshot.classes.values():
            for reason, count in stats.rejections.items():
                out[reason] = out.get(reason, 0) + count
        return out

    old, new = totals(before), totals(after)
    return {r: n - old.get(r, 0) for r, n in sorted(new.items()) if n - old.get(r, 0) > 0}
