"""``GET /metrics``: every model's telemetry in Prometheus exposition format.

A custom collector reads each batcher's :class:`TelemetrySnapshot` at scrape time, so
the hot path records nothing twice. Names start with ``carpool_``; labels are ``model``
(the name the repository serves it under, as ``/v2/models/{m}/stats`` has it) and
``class`` (plus ``reason`` and ``replica`` where they apply). The text format 0.0.4 is
served unless the scraper's ``Accept`` asks for OpenMetrics, as Prometheus does; as
prometheus_client's own handler, the body is gzipped when ``Accept-Encoding`` allows it,
and ``?name[]=...`` keeps only the samples so named.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Collection, Iterable, Iterator
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from carpool.core.batcher import Batcher
from carpool.core.policy import BatchPolicy
from carpool.core.telemetry import REJECTION_REASONS, LatencyStats, TelemetrySnapshot
from carpool.generation.telemetry import GenerationSnapshot
from carpool.server.adaptive_metrics import adaptive_metrics
from carpool.server.limits import InflightBytes
from carpool.server.openai_fields import IgnoredFields
from carpool.server.pool_metrics import pool_metrics
from carpool.server.repository import ModelRepository

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# (served model name, its batcher's snapshot, its batch-size bucket bounds)
Named = tuple[str, TelemetrySnapshot, tuple[int, ...]]


def batch_size_bounds(policy: BatchPolicy) -> tuple[int, ...]:
    """The batch-size buckets of a model under ``policy``: powers of two from 1 up to
    its largest max batch size, and each max batch size (the model's and its classes')
    with the size one below it, so ``le=max`` minus ``le=max-1`` counts the full batches;
    its preferred batch sizes too."""
    maxes = {policy.size_limit} | {
        c.max_batch_size for c in policy.classes if c.max_batch_size is not None
    }
    bounds = {*BATCH_SIZE_BOUNDS, *policy.preferred_batch_sizes}
    power = 1
    while power < max(maxes):
        power *= 2
        bounds.add(power)
    bounds |= maxes | {m - 1 for m in maxes if m > 1}
    return tuple(sorted(bounds))


def _le(bound: float) -> str:
    """A bucket bound as OpenMetrics' canonical number (``1.0``, not ``1``; ``+Inf``), as
    prometheus_client's own histograms write it and Prometheus 3 stores it."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def _buckets(stats: LatencyStats) -> list[tuple[str, float]]:
    return [(_le(b), float(n)) for b, n in stats.buckets]


def _histogram_sum(stats: LatencyStats) -> float:
    return stats.sum_s


class TelemetryCollector(Collector):
    """Turns snapshots into metric families at scrape time."""

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository
        # Each model's batch-size buckets: every bound any of its policies has had. A live
        # policy change (carpool tune makes them) adds its bounds and takes none away, so
        # no bucket series disappears under a rate() or histogram_quantile() window.
        self._bounds: dict[str, tuple[int, ...]] = {}

    def _bounds_of(self, name: str, policy: BatchPolicy) -> tuple[int, ...]:
        known = self._bounds.get(name, ())
        bounds = batch_size_bounds(policy)
        if not set(bounds) <= set(known):
            self._bounds[name] = known = tuple(sorted({*bounds, *known}))
        return known

    def collect(self) -> Iterator[Metric]:
        # Labelled by the repository's (unique) names: a batcher's own name defaults to
        # its function's, which two models may share. A generation model has no batcher
        # (its engine schedules its requests): it has only the carpool_generation_* ones.
        snapshots = [
            (m.name, b.snapshot(quantiles=False), self._bounds_of(m.name, b.policy))
            for m in self._repository
            if isinstance(b := m.batcher, Batcher)  # a front-end worker's is the engine's
        ]
        yield from _class_metrics(snapshots)
        yield from _batch_metrics(snapshots)
        yield from _replica_metrics(snapshots)
        yield from adaptive_metrics(
            [
                (m.name, state)
                for m in self._repository
                if isinstance(b := m.batcher, Batcher) and (state := b.adaptive_state()) is not None
            ]
        )
        yield from pool_metrics(
            [
                (m.name, pool.stats())
                for m in self._repository
                if isinstance(b := m.batcher, Batcher) and (pool := b.buffer_pool) is not None
            ]
        )
        services = self._repository.generation_services()
        yield from _generation_metrics(
            [(name, g.engine.snapshot(quantiles=False)) for name, g in services.items()]
        )


def _class_metrics(snapshots: list[Named]) -> Iterator[Metric]:
    labels = ["model", "class"]
    requests = CounterMetricFamily("carpool_requests", "Requests accepted.", labels=labels)
    items = CounterMetricFamily(
        "carpool_request_items", "Items in accepted requests.", labels=labels
    )
    completed = CounterMetricFamily(
        "carpool_requests_completed", "Requests answered with a result.", labels=labels
    )
    failed = CounterMetricFamily(
        "carpool_requests_failed", "Requests the model failed on.", labels=labels
    )
    rejected = CounterMetricFamily(
        "carpool_rejections", "Requests refused or dropped, by reason.", labels=[*labels, "reason"]
    )
    from_head = CounterMetricFamily(
        "carpool_refused_from_head",
        "Requests refused from their head, every queue of the model full, before their body "
        "(and so their class) was read; counted in no class.",
        labels=["model"],
    )
    pending = GaugeMetricFamily(
        "carpool_pending_requests", "Requests waiting in queue.", labels=labels
    )
    slo = GaugeMetricFamily(
        "carpool_slo_attainment",
        "Share (0 to 1) of answered and expired requests answered within the class SLO, "
        "since start.",
        labels=labels,
    )
    latency = HistogramMetricFamily(
        "carpool_request_latency_seconds",
        "End-to-end latency of answered requests, in seconds.",
        labels=labels,
    )
    queue = HistogramMetricFamily(
        "carpool_queue_wait_seconds",
        "Time from arrival to batch close of answered requests, in seconds.",
        labels=labels,
    )
    for model, snap, *_ in snapshots:
        from_head.add_metric([model], snap.num_refused_from_head)
        for name, c in snap.classes.items():
            key = [model, name]
            requests.add_metric(key, c.num_requests)
            items.add_metric(key, c.num_items)
            completed.add_metric(key, c.num_completed)
            failed.add_metric(key, c.num_failed)
            for reason in sorted({*REJECTION_REASONS, *c.rejections}):
                rejected.add_metric([*key, reason], c.rejections.get(reason, 0))
            pending.add_metric(key, c.num_pending)
            if c.slo_attainment is not None:
                slo.add_metric(key, c.slo_attainment)
            latency.add_metric(key, _buckets(c.latency), _histogram_sum(c.latency))
            queue.add_metric(key, _buckets(c.queue_wait), _histogram_sum(c.queue_wait))
    yield from (requests, items, completed, failed, rejected, from_head, pending, slo)
    yield from (latency, queue)


def _batch_metrics(snapshots: list[Named]) -> Iterator[Metric]:
    batches = CounterMetricFamily("carpool_batches", "Batches run.", labels=["model"])
    sizes = HistogramMetricFamily(
        "carpool_batch_size", "Items per batch (rows, or texts).", labels=["model"]
    )
    compute = HistogramMetricFamily(
        "carpool_batch_compute_seconds", "Model time per batch, in seconds.", labels=["model"]
    )
    fill = GaugeMetricFamily(
        "carpool_fill_ratio",
        "Mean over batches of batch size / its max batch size (0 to 1), since start.",
        labels=["model"],
    )
    effective = GaugeMetricFamily(
        "carpool_effective_compute_ratio",
        "Compute time / (compute time + time replicas held a batch open to fill), 0 to 1, "
        "since start.",
        labels=["model"],
    )
    tokens = CounterMetricFamily(
        "carpool_batch_tokens",
        "Real tokens batched (variable-length models).",
        labels=["model"],
    )
    padded = CounterMetricFamily(
        "carpool_batch_padded_slots",
        "Slots a padded model computed on padding.",
        labels=["model"],
    )
    waste = GaugeMetricFamily(
        "carpool_padding_waste_ratio",
        "Padded slots / all slots computed, 0 to 1 (0 when packed).",
        labels=["model"],
    )
    for model, snap, bounds in snapshots:
        b = snap.batches
        tokens.add_metric([model], b.num_tokens)
        padded.add_metric([model], b.num_padded_slots)
        waste.add_metric([model], b.padding_waste)
        batches.add_metric([model], b.num_batches)
        cumulative = [
            (_le(bound), float(sum(n for s, n in b.size_histogram.items() if s <= bound)))
            for bound in bounds
        ]
        cumulative.append(("+Inf", float(b.num_batches)))
        sizes.add_metric([model], cumulative, float(b.num_items))
        compute.add_metric([model], _buckets(b.compute), _histogram_sum(b.compute))
        fill.add_metric([model], b.fill_ratio)
        effective.add_metric([model], b.effective_compute_ratio)
    yield from (batches, sizes, compute, fill, effective, tokens, padded, waste)


def _replica_metrics(snapshots: list[Named]) -> Iterator[Metric]:
    busy = GaugeMetricFamily(
        "carpool_replica_busy_fraction",
        "Share (0 to 1) of its uptime a replica computed, since start.",
        labels=["model", "replica"],
    )
    # The seconds behind the since-start ratios, so that rate() gives them over a window:
    # rate(busy) is the busy fraction, rate(busy) / (rate(busy) + rate(fill_wait)) the
    # effective compute ratio.
    busy_s = CounterMetricFamily(
        "carpool_replica_busy_seconds",
        "Seconds a replica computed batches.",
        labels=["model", "replica"],
    )
    fill_wait_s = CounterMetricFamily(
        "carpool_replica_fill_wait_seconds",
        "Seconds a replica idled holding a batch open to fill.",
        labels=["model", "replica"],
    )
    balance = GaugeMetricFamily(
        "carpool_replica_balance",
        "Busy fraction of the least busy replica over the most busy one (1 is even).",
        labels=["model"],
    )
    memory = GaugeMetricFamily(
        "carpool_memory_volatility",
        "(peak - trough) / total memory reported by the runner, 0 to 1.",
        labels=["model"],
    )
    memory_peak = GaugeMetricFamily(
        "carpool_memory_peak_bytes",
        "Most memory the runner reported after a batch (on a GPU: torch's peak allocation).",
        labels=["model"],
    )
    memory_total = GaugeMetricFamily(
        "carpool_memory_total_bytes",
        "Memory the runner reported it has in all (on a GPU: the device's memory).",
        labels=["model"],
    )
    abandoned = CounterMetricFamily(
        "carpool_replicas_abandoned",
        "Replicas given up after a batch ran past batch_timeout_s, each replaced by a fresh one.",
        labels=["model"],
    )
    stuck = GaugeMetricFamily(
        "carpool_replica_threads_stuck",
        "Threads of replicas given up whose model call has not returned (a thread cannot be "
        "stopped).",
        labels=["model"],
    )
    restarts = CounterMetricFamily(
        "carpool_replica_restarts",
        "Replica processes (executor: process) started again after they died or hung.",
        labels=["model"],
    )
    for model, snap, *_ in snapshots:
        restarts.add_metric([model], sum(r.num_restarts for r in snap.replicas))
        abandoned.add_metric([model], sum(r.num_abandoned for r in snap.replicas))
        stuck.add_metric([model], sum(r.num_stuck_threads for r in snap.replicas))
        for r in snap.replicas:
            busy.add_metric([model, str(r.replica_id)], r.busy_fraction)
            busy_s.add_metric([model, str(r.replica_id)], r.busy_s)
            fill_wait_s.add_metric([model, str(r.replica_id)], r.fill_wait_s)
        balance.add_metric([model], snap.replica_balance)
        if snap.memory is not None:
            memory.add_metric([model], snap.memory.volatility)
            memory_peak.add_metric([model], snap.memory.peak_bytes)
            memory_total.add_metric([model], snap.memory.total_bytes)
    yield from (busy, busy_s, fill_wait_s, balance, memory, memory_peak, memory_total)
    yield from (abandoned, stuck, restarts)


def _generation_metrics(snapshots: list[tuple[str, GenerationSnapshot]]) -> Iterator[Metric]:
    """Generation models, in vLLM's vocabulary (``vllm:num_requests_running`` is
    ``carpool_generation_requests_running`` here)."""
    model = ["model"]
    running = GaugeMetricFamily(
        "carpool_generation_requests_running", "Requests in the running batch.", labels=model
    )
    waiting = GaugeMetricFamily(
        "carpool_generation_requests_waiting", "Requests waiting to run.", labels=model
    )
    held = GaugeMetricFamily(
        "carpool_generation_requests_held",
        "Requests held out of the steps until their clients read what they generated.",
        labels=model,
    )
    kv = GaugeMetricFamily(
        "carpool_generation_kv_cache_usage_ratio",
        "KV-cache blocks in use / all blocks, 0 to 1.",
        labels=model,
    )
    queries = CounterMetricFamily(
        "carpool_generation_prefix_cache_queries", "Prompt tokens looked up.", labels=model
    )
    hits = CounterMetricFamily(
        "carpool_generation_prefix_cache_hits", "Prompt tokens found cached.", labels=model
    )
    preemptions = CounterMetricFamily(
        "carpool_generation_preemptions", "Requests preempted (recomputed).", labels=model
    )
    prompt = CounterMetricFamily(
        "carpool_generation_prompt_tokens", "Prompt tokens prefilled.", labels=model
    )
    generated = CounterMetricFamily("carpool_generation_tokens", "Tokens generated.", labels=model)
    finished = CounterMetricFamily(
        "carpool_generation_requests_finished",
        "Requests ended, by finish reason (stop, length, abort, error).",
        labels=[*model, "finished_reason"],
    )
    histograms = {
        "time_to_first_token": ("Arrival to first token, in seconds.", "time_to_first_token"),
        "inter_token_latency": (
            "Between tokens of one request, in seconds.",
            "inter_token_latency",
        ),
        "e2e_request_latency": ("Arrival to last token, in seconds.", "e2e_latency"),
        "request_queue_time": ("Arrival to first scheduled, in seconds.", "queue_time"),
    }
    families = {
        name: HistogramMetricFamily(f"carpool_generation_{name}_seconds", text, labels=model)
        for name, (text, _) in histograms.items()
    }
    for served, snap in snapshots:
        key = [served]
        running.add_metric(key, snap.scheduler.num_running)
        waiting.add_metric(key, snap.scheduler.num_waiting)
        held.add_metric(key, snap.scheduler.num_held)
        kv.add_metric(key, snap.scheduler.kv_cache_usage)
        queries.add_metric(key, snap.scheduler.num_prefix_cache_queries)
        hits.add_metric(key, snap.scheduler.num_prefix_cache_hits)
        preemptions.add_metric(key, snap.scheduler.num_preemptions)
        prompt.add_metric(key, snap.num_prompt_tokens)
        generated.add_metric(key, snap.num_generation_tokens)
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric([*key, reason], snap.finished.get(reason, 0))
        for name, (_, field) in histograms.items():
            stats: LatencyStats = getattr(snap, field)
            families[name].add_metric(key, _buckets(stats), _histogram_sum(stats))
    yield from (running, waiting, held, kv, queries, hits, preemptions, prompt, generated, finished)
    yield from families.values()


class _Restricted(Collector):
    """Only the samples named in ``names``, as prometheus_client's ``name[]`` (whose
    ``restricted_registry`` sees no collector that does not describe itself)."""

    def __init__(self, registry: CollectorRegistry, names: Collection[str]) -> None:
        self._registry = registry
        self._names = set(names)

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            samples = [s for s in metric.samples if s.name in self._names]
            if samples:
                kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                kept.samples = samples
                yield kept


class ServerCollector(Collector):
    """The server's own figures: request bytes held across connections against
    ``--max-inflight-bytes``, and the requests refused for it."""

    def __init__(self, inflight: InflightBytes) -> None:
        self._inflight = inflight

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "carpool_inflight_bytes",
            "HTTP request body bytes held across connections, from head to answer.",
        )
        held.add_metric([], self._inflight.held_bytes)
        refused = CounterMetricFamily(
            "carpool_refused_inflight_bytes",
            "Requests refused (503) because their body would pass --max-inflight-bytes.",
        )
        refused.add_metric([], self._inflight.num_refused)
        yield from (held, refused)


class IgnoredFieldsCollector(Collector):
    """The OpenAI request fields the server ignored, as neither OpenAI nor vLLM defines
    them (``openai_fields.py``), by field name."""

    def __init__(self, fields: IgnoredFields) -> None:
        self._fields = fields

    def collect(self) -> Iterator[Metric]:
        ignored = CounterMetricFamily(
            "carpool_openai_ignored_fields",
            "Requests to /v1/completions and /v1/chat/completions that carried a field "
            "neither OpenAI nor vLLM defines, ignored (refused under --strict-openai).",
            labels=("field",),
        )
        for name, count in sorted(self._fields.counts().items()):
            ignored.add_metric((name,), count)
        yield ignored


class Metrics:
    """A private registry holding the collectors; ``render()`` is the scrape body."""

    def __init__(
        self,
        repository: ModelRepository,
        inflight: InflightBytes | None = None,
        openai_fields: IgnoredFields | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(TelemetryCollector(repository))
        if inflight is not None:
            self.registry.register(ServerCollector(inflight))
        if openai_fields is not None:
            self.registry.register(IgnoredFieldsCollector(openai_fields))

    def render(
        self, accept: bytes | None = None, names: Collection[str] = ()
    ) -> tuple[bytes, bytes]:
        """The scrape body and its content type: OpenMetrics when ``accept`` (the
        request's ``Accept`` header) asks for it, else the text format 0.0.4. With
        ``names``, only the samples so named (``carpool_batch_size_bucket``, not the
        family's ``carpool_batch_size``), as prometheus_client's ``name[]``."""
        registry: Collector = _Restricted(self.registry, names) if names else self.registry
        if accept is None or b"openmetrics" not in accept:
            return generate_latest(registry), CONTENT_TYPE
        encode, content_type = choose_encoder(accept.decode("latin-1"))
        return encode(registry), content_type.encode()

    def answer(
        self, accept: bytes | None, accept_encoding: bytes | None, query: bytes
    ) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
        """A scrape's body and headers, as prometheus_client's handler makes them:
        ``query`` (the URL's query string) may restrict it with ``name[]``, and it is
        gzipped when ``accept_encoding`` allows (Prometheus asks for gzip)."""
        names: Iterable[str] = parse_qs(query.decode("latin-1")).get("name[]", ())
        body, content_type = self.render(accept, tuple(names))
        headers = [(b"content-type", content_type)]
        if accept_encoding is not None and gzip_accepted(accept_encoding.decode("latin-1")):
            body = gzip.compress(body)
            headers.append((b"content-encoding", b"gzip"))
        return body, tuple(headers)
