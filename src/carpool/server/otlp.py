"""``carpool serve --otlp-endpoint URL``: each request's timeline as OpenTelemetry spans,
sent over OTLP/HTTP (protobuf) to a collector (Jaeger, Tempo, the OpenTelemetry
Collector...).

Per finished request, one trace::

    carpool.request   arrived ─────────────────────────────────► answered
      carpool.wait      arrived ──► batch closed        (attribute: fill wait)
      carpool.compute                  compute started ──► compute ended

with the five moments also as events of the request span, and the model, class,
outcome, items, batch size and replica as attributes. A generation request's span has a
``carpool.queue`` child (arrived to its first step) and a ``carpool.step`` child per
forward pass it was in, and events arrived, scheduled, first token, answered.

Off the request path: the trace hook only appends to a bounded queue
(:class:`OtlpExport`); a thread turns the queue into spans every ``interval_s`` and the
SDK's batch processor exports them from its own thread. Without the flag no hook is
installed (:class:`~carpool.server.timelines.TraceHub`): nothing is built per request.
Needs the ``otel`` extra.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from carpool.core.request import Outcome, RequestTrace
from carpool.errors import ConfigError
from carpool.generation.telemetry import GenerationTrace
from carpool.server.timelines import AnyTrace, TraceHub

MAX_PENDING = 65_536  # traces waiting for the export thread; past it, new ones are dropped
TRACES_PATH = "/v1/traces"
log = logging.getLogger("carpool.server.otlp")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint``: as given when it has a path, else with
    ``/v1/traces`` (the collector's base address, as ``OTEL_EXPORTER_OTLP_ENDPOINT``).

    Raises:
        ConfigError: not an http(s) URL.
    """
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError("--otlp-endpoint", endpoint, "an http(s) URL, e.g. http://host:4318")
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


class OtlpExport:
    """A :class:`TraceHub` listener sending each trace as spans to ``endpoint``."""

    def __init__(self, endpoint: str, *, interval_s: float = 0.5) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ConfigError(
                "--otlp-endpoint", endpoint, "the otel extra installed: pip install carpool[otel]"
            ) from None
        from carpool import __version__

        self.url = traces_url(endpoint)
        resource = Resource.create({"service.name": "carpool", "service.version": __version__})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("carpool.server")
        self._pending: collections.deque[tuple[str, AnyTrace]] = collections.deque()
        self.num_dropped = 0
        self._unix_offset_s = time.time() - time.monotonic()
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-otlp", daemon=True)
        self._thread.start()

    def __call__(self, model: str, trace: AnyTrace) -> None:
        if len(self._pending) < MAX_PENDING:
            self._pending.append((model, trace))
        else:
            self.num_dropped += 1

    def close(self) -> None:
        """Turn what is queued into spans, send them, and stop."""
        self._stopping.set()
        self._thread.join()
        self._provider.shutdown()  # flushes the batch processor
        if self.num_dropped:
            log.warning("OTLP: %d request traces dropped (queue full)", self.num_dropped)

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            model, trace = pending.popleft()
            try:
                if isinstance(trace, GenerationTrace):
                    self._emit_generation(model, trace)
                else:
                    self._emit(model, trace)
            except Exception:  # one odd trace must not end the export
                log.exception("OTLP: could not make spans of request %d", trace.request_id)

    def _ns(self, monotonic_s: float) -> int:
        return int((monotonic_s + self._unix_offset_s) * 1e9)

    def _emit(self, model: str, t: RequestTrace) -> None:
        attributes = {
            "carpool.model": model,
            "carpool.request_id": t.request_id,
            "carpool.class": t.class_name,
            "carpool.outcome": t.outcome.value,
            "carpool.num_items": t.num_items,
            "carpool.batch_size": t.batch_size,
            "carpool.replica_id": t.replica_id,
        }
        moments = (
            ("arrived", t.arrived_s),
            ("batch closed", t.batch_closed_s),
            ("compute started", t.compute_started_s),
            ("compute ended", t.compute_ended_s),
            ("answered", t.answered_s),
        )
        root = self._request_span(attributes, moments)
        if t.batch_closed_s == t.batch_closed_s:  # not NaN: a stage it reached
            queue = {"carpool.fill_wait_s": t.fill_wait_s, "carpool.queue_s": t.queue_s}
            self._span("carpool.wait", root, t.arrived_s, t.batch_closed_s, queue)
        if t.compute_started_s == t.compute_started_s and t.compute_ended_s == t.compute_ended_s:
            replica = {"carpool.replica_id": t.replica_id}
            self._span("carpool.compute", root, t.compute_started_s, t.compute_ended_s, replica)
        self._end(root, t.answered_s, None if t.outcome is Outcome.OK else t.outcome.value)

    def _emit_generation(self, model: str, t: GenerationTrace) -> None:
        attributes = {
            "carpool.model": model,
            "carpool.kind": "generation",
            "carpool.request_id": t.request_id,
            "carpool.class": t.class_name,
            "carpool.outcome": t.outcome,
            "carpool.num_prompt_tokens": t.num_prompt_tokens,
            "carpool.num_generated": t.num_generated,
        }
        moments = (
            ("arrived", t.arrived_s),
            ("scheduled", t.scheduled_s),
            ("first token", t.first_token_s),
            ("answered", t.answered_s),
        )
        root = self._request_span(attributes, moments)
        if t.scheduled_s == t.scheduled_s:
            self._span("carpool.queue", root, t.arrived_s, t.scheduled_s, {})
        for number, (start_s, end_s) in enumerate(t.steps):
            self._span("carpool.step", root, start_s, end_s, {"carpool.step": number})
        self._end(root, t.answered_s, None if t.outcome in ("stop", "length") else t.outcome)

    def _request_span(
        self, attributes: dict[str, Any], moments: tuple[tuple[str, float], ...]
    ) -> Any:
        """The request's root span, from its first moment, each moment it reached an
        event."""
        root = self._tracer.start_span(
            "carpool.request", start_time=self._ns(moments[0][1]), attributes=attributes
        )
        for name, moment_s in moments:
            if moment_s == moment_s:  # not NaN: a moment it reached
                root.add_event(name, timestamp=self._ns(moment_s))
        return root

    def _span(
        self, name: str, parent: Any, start_s: float, end_s: float, attributes: dict[str, Any]
    ) -> None:
        from opentelemetry import trace

        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            start_time=self._ns(start_s),
            attributes=attributes,
        )
        span.end(end_time=self._ns(end_s))

    def _end(self, root: Any, answered_s: float, error: str | None) -> None:
        """End the request's span at ``answered_s``, its status an error when ``error``."""
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=self._ns(answered_s))


def start_otlp(hub: TraceHub, endpoint: str) -> OtlpExport:
    """Export every request ``hub`` sees to ``endpoint`` until the export is closed."""
    export = OtlpExport(endpoint)
    hub.subscribe(export)
    return export
