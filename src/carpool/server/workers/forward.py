"""What a front-end worker forwards to the engine: every HTTP route but the infer fast
path and the health probes (:class:`WorkerDispatch`), and the gRPC calls whose answer
is the engine's state, configuration and statistics (:class:`WorkerServicer`).

A forwarded request is routed by the worker first (the same router over mirrors of the
same models: a 401, 404 or 405 is answered from the head, its body unread, as without
workers), then sent whole (method, path, query, the header fields carpool reads, body)
and answered by the engine's own router and handlers, so ``/metrics``, ``/stats`` and
``/policy`` give one answer whichever worker serves them. A streamed answer (server-sent
events) comes back chunk by chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
import orjson
from google.protobuf import json_format  # type: ignore[import-untyped]  # no stubs installed

from carpool.server.app import KServeApp
from carpool.server.grpc import InferenceServicer, refused_call
from carpool.server.http.dispatch import Dispatch
from carpool.server.http.exchange import Exchange
from carpool.server.http.handlers import Stream
from carpool.server.http.router import RouteKind
from carpool.server.http.states import ConnectionPort
from carpool.server.infer import error_response
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import ModelRepository
from carpool.server.workers.front import Forwarded, Link
from carpool.server.workers.records import Kind

# The gRPC status of a forwarded answer's HTTP status (server/errors.py maps both ways).
_GRPC_CODES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    429: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip

# The routes a worker answers itself: the probes, whatever the method or query, and the
# version (the same package as the engine's).
_ANSWERED_HERE = frozenset({RouteKind.HEALTH_LIVE, RouteKind.HEALTH_READY, RouteKind.VERSION})


def header_fields(exchange: Exchange) -> dict[str, str | None]:
    """The header fields carpool's handlers read, as the engine rebuilds them."""
    request = exchange.request
    assert request is not None, "a routed exchange has its request"
    return {
        name: None if value is None else value.decode("latin-1")
        for name, value in vars_of(request.headers).items()
    }


def vars_of(headers: Any) -> dict[str, bytes | None]:
    return {name: getattr(headers, name) for name in headers.__dataclass_fields__}


class WorkerDispatch(Dispatch):
    """The worker's dispatch: the fast path as in one process (its model's batcher is a
    :class:`~carpool.server.workers.front.RemoteFront`), every other route forwarded.
    ``counts``: the worker's counters, sent ahead of a forwarded ``/metrics`` so the
    scrape it answers counts this worker up to that request."""

    __slots__ = ("_counts", "_link")

    def __init__(self, app: KServeApp, link: Link, counts: Callable[[], dict[str, Any]]) -> None:
        super().__init__(app)
        self._link = link
        self._counts = counts

    async def _answer_route(self, conn: ConnectionPort, exchange: Exchange) -> None:
        request = exchange.request
        assert request is not None, "a route exchange is routed"
        found = exchange.route
        if found is not None and found.kind in _ANSWERED_HERE:
            # A probe however it is asked (POST /ping, HEAD, a query), and the version:
            # from this worker's readiness flags, without the engine, as in its head.
            await super()._answer_route(conn, exchange)
            return
        link = self._link
        try:
            if request.path == "/metrics":
                link.send(Kind.COUNTS, self._counts())
            header = {
                "method": request.method,
                "path": request.path,
                "query": request.query.decode("latin-1"),
                "headers": header_fields(exchange),
                "arrival_s": request.arrival_s,
            }
            request_id, future = link.request(Kind.FORWARD, header, None, exchange.take())
            exchange.is_watched = True  # the connection's loss cancels this task
            try:
                forwarded: Forwarded = await future
            except asyncio.CancelledError:
                link.cancel(request_id)
                raise
            finally:
                exchange.is_watched = False
        except Exception as exc:
            conn.answer(exchange, *error_response(exc, is_openai=exchange.is_openai))
            return
        if forwarded.chunks is None:
            conn.answer(exchange, forwarded.status, forwarded.body, forwarded.headers)
            return
        stream = Stream(_chunks(forwarded.chunks, link, request_id), forwarded.headers)
        exchange.is_watched = True
        try:
            await conn.stream(exchange, stream)
        finally:
            exchange.is_watched = False


async def _chunks(
    queue: asyncio.Queue[bytes | None], link: Link, request_id: int
) -> AsyncGenerator[bytes, None]:
    """A streamed answer's chunks as they come; closed early (its client left), the
    engine's stream is cancelled."""
    is_done = False
    try:
        while (data := await queue.get()) is not None:
            yield data
        is_done = True
    finally:
        if not is_done:
            link.cancel(request_id)


class WorkerServicer(InferenceServicer):
    """The gRPC servicer over the worker's mirrors: inference through the ring, as the
    HTTP fast path; configuration and statistics asked of the engine (its REST JSON,
    parsed into the same messages the one-process servicer sends)."""

    def __init__(self, repository: ModelRepository, link: Link) -> None:
        super().__init__(repository)
        self._link = link

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelConfigResponse:
        try:
            path = self._model_path(request, "config")
        except Exception as exc:
            return refused_call(context, exc, pb.ModelConfigResponse())
        document = await self._ask(context, path)
        if document is None:
            return pb.ModelConfigResponse()
        config = pb.ModelConfig()
        json_format.ParseDict(document, config, ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelStatisticsResponse:
        try:
            path = self._model_path(request, "stats") if request.name else "/v2/models/stats"
        except Exception as exc:
            return refused_call(context, exc, pb.ModelStatisticsResponse())
        document = await self._ask(context, path)
        answer = pb.ModelStatisticsResponse()
        if document is not None:
            json_format.ParseDict(document, answer, ignore_unknown_fields=True)
        return answer

    def _model_path(self, request: Any, action: str) -> str:
        """The engine's path for ``action`` of the model ``request`` names, once the
        worker's mirror knows it (``NotFound`` as in one process, else). Was: the name and
        version sent percent-encoded, which errors quoted encoded, and which took seconds
        of the worker's loop for a version of tens of MB."""
        model = self.repository.get(request.name, request.version or None)
        return f"/v2/models/{model.name}/{action}"  # its only version, asked or not

    async def _ask(
        self, context: grpc.aio.ServicerContext[Any, Any], path: str
    ) -> dict[str, Any] | None:
        """The engine's JSON answer to ``GET path``; None (the call's status set) when it
        is an error."""
        try:
            forwarded = await self._forward_get(path)
        except Exception as exc:
            status, body, _ = error_response(exc)
            forwarded = Forwarded(status, (), body)
        document: dict[str, Any] = orjson.loads(forwarded.body)
        if forwarded.status == 200:
            return document
        context.set_code(grpc.StatusCode[_GRPC_CODES.get(forwarded.status, "INTERNAL")])
        context.set_details(str(document.get("error", "")))
        return None

    async def _forward_get(self, path: str) -> Forwarded:
        header = {"method": "GET", "path": path, "query": "", "headers": {}, "arrival_s": 0.0}
        request_id, future = self._link.request(Kind.FORWARD, header)
        try:
            forwarded: Forwarded = await future
        except asyncio.CancelledError:
            self._link.cancel(request_id)
            raise
        return forwarded
