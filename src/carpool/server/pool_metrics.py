"""The ``carpool_buffer_pool_*`` families: each batch buffer pool's reuse and size
(models served with ``buffer_pool: true``; see :mod:`carpool.core.buffer_pool`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.core.buffer_pool import PoolStats


def pool_metrics(pools: list[tuple[str, PoolStats]]) -> Iterator[Metric]:
    """One sample per model and family, for the models that have a pool."""
    labels = ["model"]
    hits = CounterMetricFamily(
        "carpool_buffer_pool_hits", "Batches collated into a kept buffer.", labels=labels
    )
    misses = CounterMetricFamily(
        "carpool_buffer_pool_misses",
        "Batch buffers allocated because none of their size bucket was idle.",
        labels=labels,
    )
    evictions = CounterMetricFamily(
        "carpool_buffer_pool_evictions",
        "Idle buffers dropped, least recently used first, to keep within buffer_pool_mb.",
        labels=labels,
    )
    held = GaugeMetricFamily(
        "carpool_buffer_pool_bytes", "Bytes of idle batch buffers the pool keeps.", labels=labels
    )
    budget = GaugeMetricFamily(
        "carpool_buffer_pool_budget_bytes",
        "Most bytes of idle buffers the pool keeps (buffer_pool_mb).",
        labels=labels,
    )
    for model, stats in pools:
        hits.add_metric([model], stats.hits)
        misses.add_metric([model], stats.misses)
        evictions.add_metric([model], stats.evictions)
        held.add_metric([model], stats.bytes_held)
        budget.add_metric([model], stats.budget_bytes)
    yield from (hits, misses, evictions, held, budget)
