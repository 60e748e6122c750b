"""KServe inference over HTTP/1.1 without a task per request.

uvicorn's httptools protocol runs every request as an ASGI task: a scope, an event, a
task, the app's awaits, a watcher for disconnects and two writes. On one core shared with
the model that path cost about 145 µs of CPU per W1 request (`docs/benchmarks.md`).
:class:`InferProtocol` is that protocol with one route taken out of ASGI::

    POST /v2/models/{m}[/versions/{v}]/infer   (models answered by their batcher)

Its body is collected by the parser callbacks, decoded and checked on the spot, queued on
the model's batcher with :meth:`Batcher.enqueue_many`, and the response is written in one
``transport.write`` from the future's done-callback. A connection lost while the request
is queued withdraws it (the model never sees it). Everything else — other routes, other
models, errors in routing, pipelined requests waiting their turn — is uvicorn's own path
into :class:`KServeApp`, so both answer with the same decoder, encoder and error mapping.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from carpool.core.request import Request
from carpool.server.app import (
    InferCall,
    KServeApp,
    error_response,
    infer_response,
    prepare_infer,
)
from carpool.server.errors import NotFound, PayloadTooLarge
from carpool.server.repository import ServedModel

log = logging.getLogger(__name__)

_HEADER_LENGTH = b"inference-header-content-length"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
Headers = tuple[tuple[bytes, bytes], ...]


def protocol_for(app: KServeApp) -> type[HttpToolsProtocol]:
    """The uvicorn ``http`` protocol class serving ``app`` with the infer fast path."""
    return type("InferProtocol", (InferProtocol,), {"kserve": app})


class _Exchange:
    """One fast-path request: its model, body so far, and its queued batcher request."""

    __slots__ = ("chunks", "cycle", "model", "queued", "size")

    def __init__(self, cycle: RequestResponseCycle, model: ServedModel) -> None:
        self.cycle = cycle
        self.model = model
        self.chunks: list[bytes] = [bytes(cycle.body)] if cycle.body else []
        self.size = len(cycle.body)
        self.queued: Request | None = None


class InferProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; ``POST .../infer`` for batched models skips ASGI."""

    kserve: KServeApp  # set by protocol_for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._exchange: _Exchange | None = None

    # -- where the fast path forks off uvicorn's --------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        model = self._fast_model(cycle) if app is self.app else None
        if model is None:
            super()._start_asgi_task(cycle, app)
            return
        exchange = self._exchange = _Exchange(cycle, model)
        if cycle.more_body:
            if cycle.waiting_for_100_continue:
                cycle.waiting_for_100_continue = False
                self.transport.write(_CONTINUE)
            self.flow.resume_reading()  # uvicorn pauses a pipelined or large body
        else:  # a pipelined request, read in full while the one before it ran
            self._dispatch(exchange)

    def on_body(self, body: bytes) -> None:
        exchange = self._exchange
        if exchange is None or exchange.cycle is not self.cycle:
            super().on_body(body)
            return
        if exchange.cycle.response_complete:
            return  # answered early (413); the rest of the body is ignored
        exchange.chunks.append(body)
        exchange.size += len(body)
        limit = self.kserve.max_body_bytes
        if exchange.size > limit:
            exchange.cycle.keep_alive = False  # the unread rest makes the connection unusable
            self._answer(exchange, *error_response(PayloadTooLarge(exchange.size, limit)))

    def on_message_complete(self) -> None:
        exchange = self._exchange
        if exchange is None or exchange.cycle is not self.cycle:
            super().on_message_complete()
            return
        exchange.cycle.more_body = False
        if not exchange.cycle.response_complete:
            self._dispatch(exchange)

    def connection_lost(self, exc: Exception | None) -> None:
        exchange = self._exchange
        if exchange is not None and exchange.queued is not None:
            exchange.model.batcher.cancel(exchange.queued)
            exchange.queued = None
        super().connection_lost(exc)

    # -- the fast path ----------------------------------------------------------------

    def _fast_model(self, cycle: RequestResponseCycle) -> ServedModel | None:
        """The model when ``cycle`` is an infer call its batcher answers, else None."""
        scope = cycle.scope
        if scope["method"] != "POST":
            return None
        parts = scope["path"].split("/")
        # ["", "v2", "models", name, "infer"] or [..., name, "versions", v, "infer"]
        if len(parts) == 5:
            version = None
        elif len(parts) == 7 and parts[4] == "versions":
            version = parts[5]
        else:
            return None
        if parts[1] != "v2" or parts[2] != "models" or parts[-1] != "infer":
            return None
        try:
            model = self.kserve.repository.get(parts[3], version)
        except NotFound:
            return None  # the ASGI path answers 404 with its message
        return model if model.infer is None and model.batcher.is_running else None

    def _dispatch(self, exchange: _Exchange) -> None:
        body = b"".join(exchange.chunks)
        exchange.chunks = []
        model = exchange.model
        try:
            call = prepare_infer(model, body, _header(exchange.cycle, _HEADER_LENGTH))
            queued = model.batcher.enqueue_many(call.payload, **call.options)
        except Exception as exc:
            self._answer(exchange, *error_response(exc))
            return
        exchange.queued = queued
        queued.future.add_done_callback(functools.partial(self._landed, exchange, call))

    def _landed(self, exchange: _Exchange, call: InferCall, future: asyncio.Future[Any]) -> None:
        exchange.queued = None
        if future.cancelled() or exchange.cycle.disconnected:
            return
        model = exchange.model
        try:
            error = future.exception()
            if error is not None:
                raise error
            answer = infer_response(model, call, model.outputs_of(future.result()))
        except Exception as exc:
            answer = error_response(exc)
        self._answer(exchange, *answer)

    def _answer(self, exchange: _Exchange, status: int, body: bytes, headers: Headers) -> None:
        """Write status line, headers and body at once; then what uvicorn does after a
        response: close or keep alive, start the next pipelined request."""
        cycle = exchange.cycle
        if self._exchange is exchange:
            self._exchange = None
        parts = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        self.transport.write(b"".join(parts))
        cycle.response_started = cycle.response_complete = True
        if cycle.access_log:
            self._log_access(cycle, status)
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def _log_access(self, cycle: RequestResponseCycle, status: int) -> None:
        client = self.client
        self.access_logger.info(
            '%s - "%s %s HTTP/%s" %d',
            f"{client[0]}:{client[1]}" if client else "-",
            cycle.scope["method"],
            cycle.scope["path"],
            cycle.scope["http_version"],
            status,
        )


def _header(cycle: RequestResponseCycle, name: bytes) -> bytes | None:
    for key, value in cycle.scope["headers"]:
        if key == name:
            return bytes(value)
    return None
