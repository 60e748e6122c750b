"""What a server holds for its clients, and its face as an ASGI app.

:class:`KServeApp` is the served state every request reads: the model repository, the
limits and the bytes held against them, the API key, the waiting room, metrics and the
infer plans. ``carpool serve`` serves it over carpool's own HTTP/1.1 protocol
(:mod:`carpool.server.http`); the app is also a plain ASGI callable, so any ASGI server
(uvicorn, hypercorn) can mount it instead, with the same router, handlers, body check and
error mapping (:mod:`carpool.server.http.router`, :mod:`~carpool.server.http.handlers`)::

    uvicorn.run(KServeApp(repository), lifespan="on")   # starts and drains the models

With an API key (:mod:`carpool.server.access`) every route but the probes
(``/v2/health/*``, ``/health``, ``/ping``) and ``/metrics`` (unless protected) answers a
request without it 401, its body unread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import aclosing
from typing import Any, TypeVar

from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.dashboard import Dashboard
from carpool.server.errors import DEFAULT_MAX_REQUEST_BYTES
from carpool.server.http.body import BodyBytes, BodyCheck, declared_too_large
from carpool.server.http.handlers import Call, Stream, respond
from carpool.server.http.headers import RequestHeaders, read_headers
from carpool.server.http.router import HttpRequest, route
from carpool.server.infer import Headers, InferPlans, error_response
from carpool.server.limits import InflightBytes, ServerLimits, over_inflight_bytes
from carpool.server.metrics import Metrics
from carpool.server.openai_fields import IgnoredFields
from carpool.server.repository import ModelRepository, ServedModel
from carpool.server.timelines import TraceHub
from carpool.server.waiting import WaitingRoom

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

_CLOSE = (b"connection", b"close")


class KServeApp:
    """The served state, and the ASGI application over it: it starts the models' batchers
    on lifespan startup and drains them on shutdown, so every accepted request is answered
    before the process exits. ``access``: the API key it requires and whether a policy may
    be changed (by default no key, and no policy changes). ``strict_openai``: refuse the
    OpenAI request fields no one defines instead of ignoring them (``openai_fields.py``)."""

    def __init__(
        self,
        repository: ModelRepository,
        *,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        limits: ServerLimits | None = None,
        access: Access = DEFAULT_ACCESS,
        dashboard: bool = False,
        strict_openai: bool = False,
    ) -> None:
        self.repository = repository
        # Sampled by carpool serve (server/run.py); the ASGI app alone serves it empty.
        self.dashboard = Dashboard(repository) if dashboard else None
        self.max_body_bytes = max_body_bytes
        self.limits = limits if limits is not None else ServerLimits()
        self.inflight = InflightBytes(self.limits.max_inflight_bytes)
        self.access = access
        self.waiting_room = WaitingRoom()
        self.openai_fields = IgnoredFields(strict_openai)
        self.metrics = Metrics(repository, self.inflight, self.openai_fields)
        self.plans = InferPlans()
        self.timelines = TraceHub(repository)  # request traces: /v2/timelines, OTLP
        # The infer fast path's request targets, each with the model it names
        # (server/http/dispatch.py): at most two a model (with and without its version),
        # as only the served ones are kept.
        self.infer_routes: dict[bytes, ServedModel] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.repository.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.repository.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = read_headers(scope["headers"])
        request = HttpRequest(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            headers,
            time.monotonic(),
        )
        body = BodyBytes()
        try:
            found = route(self.repository, self.access, request)
            if found.reads_body:
                await self._read_body(headers, body, receive)

            def watch(work: Awaitable[T]) -> Awaitable[T]:
                return _unless_disconnected(work, receive)

            answer = await respond(self, Call(found, request, body.take(), watch))
            if isinstance(answer, Stream):
                await _stream(send, receive, answer)
            else:
                await _respond(send, *answer)
        except _ClientGone:
            return  # nobody to answer
        except Exception as exc:
            status, data, fields = error_response(exc, is_openai=request.is_openai)
            if getattr(exc, "is_unread", False):  # the rest of the body is left unread:
                fields = (*fields, _CLOSE)  # the connection cannot carry another request
            await _respond(send, status, data, fields)
        finally:
            body.release(self.inflight)

    async def _read_body(self, headers: RequestHeaders, body: BodyBytes, receive: Receive) -> None:
        """Receive the request body into ``body``, held to the server's limits."""
        too_large = declared_too_large(headers.content_length, self.max_body_bytes)
        if too_large is not None:
            raise too_large
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            check = body.add(message.get("body", b""), self.max_body_bytes, self.inflight)
            if check is BodyCheck.TOO_LARGE:
                raise body.too_large(self.max_body_bytes)
            if check is BodyCheck.OVER_BUDGET:
                raise over_inflight_bytes(self.limits)
            if not message.get("more_body", False):
                return


class _ClientGone(Exception):
    """The client disconnected before its request was answered."""


async def _unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Await ``work`` in this task; if the client disconnects first, cancel this task (a
    queued request is then dropped before it reaches the model) and raise
    :class:`_ClientGone`. One watcher task per request."""
    current = asyncio.current_task()
    assert current is not None, "called from a task"
    watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, current))
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            current.uncancel()  # our own cancellation: it ends here, as _ClientGone
            raise _ClientGone() from None
        raise
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()


async def _stream(send: Send, receive: Receive, stream: Stream) -> None:
    """Server-sent events: each chunk is sent as it comes. A client that disconnects
    cancels the pump, which closes the chunks (and so aborts the generation)."""
    await send({"type": "http.response.start", "status": 200, "headers": list(stream.headers)})

    async def pump() -> None:
        async with aclosing(stream.chunks) as chunks:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await _unless_disconnected(pump(), receive)


async def _respond(send: Send, status: int, body: bytes, headers: Headers) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
