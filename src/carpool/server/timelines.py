"""Per-request timelines, handed to whoever listens: ``GET /v2/timelines`` and the OTLP
exporter (``carpool serve --otlp-endpoint``).

A batcher builds a request's :class:`~carpool.core.request.RequestTrace` only while it has
a trace hook, so the hub installs one on every batcher when its first listener subscribes
and takes them off when the last one leaves: a server nobody traces pays nothing per
request. A listener is called on the event loop, once per finished request, and must only
keep the trace (a bounded append); its real work happens elsewhere.

``GET /v2/timelines?seconds=S`` listens for S seconds (at most :data:`MAX_CAPTURE_S`; less
when the server stops meanwhile), then answers every request finished meanwhile as JSON::

    {"clock": "monotonic", "unix_offset_s": ..., "seconds": S, "num_dropped": 0,
     "timelines": [{"model": "mlp", "request_id": 7, "class_name": "default",
                    "outcome": "ok", "num_items": 1, "batch_size": 8, "replica_id": 0,
                    "arrived_s": ..., "batch_closed_s": ..., "compute_started_s": ...,
                    "compute_ended_s": ..., "answered_s": ..., "fill_wait_s": ...}, ...]}

A generation model's request (continuous batching: no batches, steps) reads
``{"model": ..., "kind": "generation", "request_id", "class_name", "outcome",
"num_prompt_tokens", "num_generated", "arrived_s", "scheduled_s", "first_token_s",
"answered_s", "steps": [[start_s, end_s], ...]}``, one pair per forward pass it was in; a
batched model's carries ``"kind": "batch"``.

Times are seconds of the server's monotonic clock (``unix_offset_s`` added makes them Unix
time); a stage a request never reached (one that expired in its queue) is null.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from carpool.core.batcher import Batcher
from carpool.core.request import RequestTrace
from carpool.errors import InvalidInput
from carpool.generation.telemetry import GenerationTrace
from carpool.server.repository import ModelRepository

AnyTrace = RequestTrace | GenerationTrace
Listener = Callable[[str, AnyTrace], None]  # (model name, its request's trace)
MAX_CAPTURE_S = 300.0
# One way to match each text (a backtracking pattern took seconds on a long run of digits)
_DECIMAL = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?", re.ASCII)
_MAX_NUMBER_CHARS = 32  # past it, not a number of seconds anyone means
MAX_CAPTURED = 200_000  # timelines one capture keeps; later ones are counted as dropped
_MOMENTS = (
    "arrived_s", "batch_closed_s", "compute_started_s", "compute_ended_s", "answered_s",
)  # fmt: skip


class TraceHub:
    """The listeners of a repository's request traces; hooks on its batchers while any."""

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository
        self._listeners: list[Listener] = []
        self._closed = asyncio.Event()

    def close(self) -> None:
        """The server is stopping: captures in flight end now and answer what they hold
        (else one would hold the drain up for its whole length)."""
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    @property
    def num_listeners(self) -> int:
        return len(self._listeners)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` with each finished request from now on."""
        self._listeners.append(listener)
        if len(self._listeners) == 1:
            self._hook(on=True)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener``; the last one leaving takes the hooks off."""
        self._listeners.remove(listener)
        if not self._listeners:
            self._hook(on=False)

    def _hook(self, *, on: bool) -> None:
        for model in self._repository:
            hook = self._hook_for(model.name) if on else None
            # A front-end worker's model is the engine's: its hub records there.
            if isinstance(model.batcher, Batcher):
                model.batcher.set_trace_hook(hook)
            if model.generation is not None:
                model.generation.engine.set_trace_hook(hook)

    def _hook_for(self, name: str) -> Callable[[AnyTrace], None]:
        listeners = self._listeners  # the same list, as listeners come and go

        def publish(trace: AnyTrace) -> None:
            for listener in listeners:
                listener(name, trace)

        return publish


class Capture:
    """A listener keeping up to ``max_captured`` timelines, counting those past it."""

    def __init__(self, max_captured: int = MAX_CAPTURED) -> None:
        self.max_captured = max_captured
        self.timelines: list[tuple[str, AnyTrace]] = []
        self.num_dropped = 0

    def __call__(self, model: str, trace: AnyTrace) -> None:
        if len(self.timelines) < self.max_captured:
            self.timelines.append((model, trace))
        else:
            self.num_dropped += 1


def capture_seconds(query: bytes) -> float:
    """The ``seconds`` of a ``/v2/timelines`` query (default 10).

    Raises:
        InvalidInput: not a number in (0, MAX_CAPTURE_S].
    """
    # A blank value is refused, not taken for the default; and only a plain decimal
    # number (float() also takes "1_0" and Unicode spaces around it)
    values = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("seconds", ["10"])
    text = values[-1]
    is_number = len(text) <= _MAX_NUMBER_CHARS and _DECIMAL.fullmatch(text) is not None
    seconds = float(text) if is_number else math.nan
    if not 0 < seconds <= MAX_CAPTURE_S:
        raise InvalidInput(
            f"/v2/timelines?seconds={values[-1]}: expected seconds to capture, a number "
            f"above 0 and at most {MAX_CAPTURE_S:g}"
        )
    return seconds


async def capture(hub: TraceHub, seconds: float) -> dict[str, Any]:
    """Listen to ``hub`` for ``seconds``, or until it closes; the JSON document of what
    finished meanwhile (``seconds``: how long it listened)."""
    listener = Capture()
    hub.subscribe(listener)
    started_s = time.monotonic()
    try:
        await asyncio.wait_for(hub.wait_closed(), seconds)
    except TimeoutError:
        pass  # the whole time asked for
    finally:
        hub.unsubscribe(listener)
    return {
        "clock": "monotonic",
        "unix_offset_s": time.time() - time.monotonic(),
        "seconds": round(time.monotonic() - started_s, 6),
        "num_dropped": listener.num_dropped,
        "timelines": [timeline_document(model, t) for model, t in listener.timelines],
    }


def timeline_document(model: str, trace: AnyTrace) -> dict[str, Any]:
    """One request's timeline as JSON: NaN moments (never reached) as null."""
    if isinstance(trace, GenerationTrace):
        return _generation_document(model, trace)
    document: dict[str, Any] = {
        "model": model,
        "kind": "batch",
        "request_id": trace.request_id,
        "class_name": trace.class_name,
        "outcome": trace.outcome.value,
        "num_items": trace.num_items,
        "batch_size": trace.batch_size,
        "replica_id": trace.replica_id,
        "fill_wait_s": _finite(trace.fill_wait_s),
    }
    for name in _MOMENTS:
        document[name] = _finite(getattr(trace, name))
    return document


def _generation_document(model: str, trace: GenerationTrace) -> dict[str, Any]:
    return {
        "model": model,
        "kind": "generation",
        "request_id": trace.request_id,
        "class_name": trace.class_name,
        "outcome": trace.outcome,
        "num_prompt_tokens": trace.num_prompt_tokens,
        "num_generated": trace.num_generated,
        "arrived_s": trace.arrived_s,
        "scheduled_s": _finite(trace.scheduled_s),
        "first_token_s": _finite(trace.first_token_s),
        "answered_s": trace.answered_s,
        "steps": [list(step) for step in trace.steps],
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
