"""``/metrics`` of ``carpool serve --workers N``: each front-end worker's counters, next
to the engine's own (registered on the engine's registry)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from carpool.server.workers.peer import Peer


class WorkerCollector:
    """``carpool_worker_*``: each front-end worker's counters, for ``/metrics``."""

    def __init__(self, peers: list[Peer], restarts: list[int]) -> None:
        self._peers = peers
        self._restarts = restarts  # by worker, kept up to date by the engine

    def collect(self) -> Iterator[Metric]:
        labels = ["worker"]
        requests = CounterMetricFamily(
            "carpool_worker_requests",
            "HTTP requests a front-end worker answered (reported by the worker).",
            labels=labels,
        )
        handoffs = CounterMetricFamily(
            "carpool_worker_handoffs",
            "Requests a front-end worker handed to the engine (infer, forwarded routes).",
            labels=labels,
        )
        restarts = CounterMetricFamily(
            "carpool_worker_restarts", "Times a front-end worker was started again.", labels=labels
        )
        inflight = GaugeMetricFamily(
            "carpool_worker_inflight", "Hand-offs the engine has not answered yet.", labels=labels
        )
        for peer in self._peers:
            worker = [str(peer.index)]
            requests.add_metric(worker, peer.num_requests)
            handoffs.add_metric(worker, peer.num_handoffs)
            restarts.add_metric(worker, self._restarts[peer.index])
            inflight.add_metric(worker, peer.num_inflight)
        yield from (requests, handoffs, restarts, inflight)
