"""``/metrics`` for ``max_delay_s``/``max_batch_size`` "auto": what the adaptive
controller (:mod:`carpool.core.adaptive`) has in force, per model and class, and the
batch-time line it fitted, per model. Only models whose policy has "auto" appear."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from carpool.core.adaptive import AdaptiveState


def adaptive_metrics(states: list[tuple[str, AdaptiveState]]) -> Iterator[Metric]:
    """The ``carpool_adaptive_*``, ``carpool_arrival_rate*`` and ``carpool_batch_time_fit_*``
    gauges of ``(model name, controller state)`` pairs."""
    labels = ["model", "class"]
    delay = GaugeMetricFamily(
        "carpool_adaptive_delay_seconds",
        "Window a lone request of the class gets now for company, in seconds (max_delay_s auto).",
        labels=labels,
    )
    size = GaugeMetricFamily(
        "carpool_adaptive_batch_size",
        "Batch size the controller waits for now (max_delay_s auto; else its size cap), "
        "in the model's budget unit (carpool_adaptive_unit).",
        labels=labels,
    )
    max_size = GaugeMetricFamily(
        "carpool_adaptive_max_batch_size",
        "Most a batch led by the class may hold now, in the model's budget unit "
        "(max_batch_size auto, and the caps that keep higher classes within slo_s).",
        labels=labels,
    )
    rate = GaugeMetricFamily(
        "carpool_arrival_rate",
        "Estimated arrival rate of the class, in requests per second (about the last second).",
        labels=labels,
    )
    company = GaugeMetricFamily(
        "carpool_arrival_rate_while_waiting",
        "Arrivals per second of the class over the time one of its requests was waiting, "
        "in the model's budget unit: the company a wait can expect, which the delay is "
        "chosen from.",
        labels=labels,
    )
    closed = GaugeMetricFamily(
        "carpool_adaptive_closed_loop_share",
        "Share of the class's landed batches whose requests came straight back (moving "
        "average): at 0.5 or more the class is a closed loop, and a free replica waits for "
        "the clients still on their way back.",
        labels=labels,
    )
    refusing = GaugeMetricFamily(
        "carpool_adaptive_refusing",
        "1 while over 1% of the class's arrivals are refused at admission (a queue bound): "
        "under max_queue_time_s its batches are then capped at two within 80% of its slo_s.",
        labels=labels,
    )
    overhead = GaugeMetricFamily(
        "carpool_batch_time_fit_overhead_seconds",
        "Fitted fixed time of a batch, in seconds: t(b) = overhead + per_item * b.",
        labels=["model"],
    )
    per_item = GaugeMetricFamily(
        "carpool_batch_time_fit_per_item_seconds",
        "Fitted time per item of a batch (per token or cost unit under a budget), in "
        "seconds: t(b) = overhead + per_item * b.",
        labels=["model"],
    )
    stretch = GaugeMetricFamily(
        "carpool_batch_time_fit_stretch",
        "A batch's span over the model's own time (moving average; 1 when the model has "
        "its core to itself, more when the event loop also serves requests between its "
        "steps).",
        labels=["model"],
    )
    unit = GaugeMetricFamily(
        "carpool_adaptive_unit",
        "1 for the unit the controller counts batches in: items, or tokens under "
        "max_batch_tokens, or cost under max_batch_cost.",
        labels=["model", "unit"],
    )
    for model, state in states:
        for c in state.classes:
            key = [model, c.name]
            delay.add_metric(key, c.delay_s)
            size.add_metric(key, c.batch_size)
            max_size.add_metric(key, c.max_batch_size)
            rate.add_metric(key, c.arrival_rate_rps)
            company.add_metric(key, c.company_rate_rps)
            closed.add_metric(key, c.closed_loop_share)
            refusing.add_metric(key, float(c.refusing))
        overhead.add_metric([model], state.overhead_s)
        per_item.add_metric([model], state.per_item_s)
        stretch.add_metric([model], state.stretch)
        unit.add_metric([model, state.unit], 1.0)
    yield from (delay, size, max_size, rate, company, closed, refusing)
    yield from (overhead, per_item, stretch, unit)
