"""Where a request goes once its head is in, and how its answer is made.

::

    POST /v2/models/{m}[/versions/{v}]/infer   a model its batcher answers: the fast path
    GET  /v2/health/live | /v2/health/ready    answered from the head, in its turn
    GET  /health | /ping                       (vLLM's probes, ready as /v2/health/ready)
    anything else                              its route's handler, in a task

The fast path takes no task: the body is decoded and checked on the spot
(:func:`carpool.server.infer.prepare_infer`), queued with :meth:`Batcher.enqueue_many`,
and the answer is written in one ``transport.write`` from the future's done-callback. A
connection lost while the request is queued withdraws it: the model never sees it. Under
overload, a request is refused from its head (429, or 503 past ``--max-inflight-bytes``)
with an answer prepared once, its body read and dropped undecoded, and its connection
waits for room before it is read again (:mod:`carpool.server.waiting`).

A health probe is answered by the protocol itself, in its turn: under overload it must
not wait behind the tasks of request handling, or a kubelet would restart a server that
is only busy. Every other route goes through :mod:`carpool.server.http.router` and
:mod:`~carpool.server.http.handlers`, as the ASGI app does.
"""

from __future__ import annotations

import asyncio
import functools
import urllib.parse
from collections.abc import Awaitable
from typing import Any, TypeVar

import httptools

from carpool.server.app import KServeApp
from carpool.server.encoding import response_encoding
from carpool.server.http.body import declared_too_large
from carpool.server.http.exchange import Exchange, ExchangeKind, Head
from carpool.server.http.handlers import Call, Stream, respond
from carpool.server.http.headers import RequestHeaders, declared_length, read_headers
from carpool.server.http.refusals import Refused
from carpool.server.http.router import HttpRequest, infer_model, route
from carpool.server.http.states import ConnectionPort, ConnectionState, Room
from carpool.server.infer import (
    Answer,
    compressed,
    error_response,
    infer_response,
    prepare_infer,
)
from carpool.server.limits import over_inflight_bytes
from carpool.server.repository import ServedModel

# The probes answered from the head, each with whether it asks for readiness.
_HEALTH = {
    b"/v2/health/live": False,
    b"/v2/health/ready": True,
    b"/health": True,  # vLLM's
    b"/ping": True,  # vLLM's (SageMaker's)
}
T = TypeVar("T")
MAX_PREPARED_REFUSALS = 256  # one per model and bound, a few limits: never many
_INFER, _ROUTE, _REFUSAL = ExchangeKind.INFER, ExchangeKind.ROUTE, ExchangeKind.REFUSAL
_CLOSED = ConnectionState.CLOSED


# Enum members as module names: a class attribute of an Enum is a slow lookup, and these
# are read for every request.
_OUT, _WAITING, _HAS_PLACE = Room.OUT, Room.WAITING, Room.HAS_PLACE


class Dispatch:
    """Dispatches the requests of a server's connections (one per server)."""

    __slots__ = ("_refusals", "app")

    def __init__(self, app: KServeApp) -> None:
        self.app = app
        self._refusals: dict[str, Answer] = {}

    # -- the head --------------------------------------------------------------------

    def head(self, conn: ConnectionPort, head: Head) -> Exchange:
        """The exchange for a complete head: a probe, the fast path, or a route.

        Raises:
            Refused: the request target is not a valid URL path (400).
        """
        method, url, version, keep_alive = head.method, head.url, head.http_version, head.keep_alive
        asks_ready = _HEALTH.get(url)
        if asks_ready is not None and method == b"GET":
            probe = Exchange(
                _ROUTE, "GET", url.decode("latin-1"), version, keep_alive, head.arrival_s
            )
            is_ready = not asks_ready or self.app.repository.is_ready
            probe.head_answer = (200, b"", ()) if is_ready else (503, b"", ())
            probe.keeps_body = False
            return probe
        headers = read_headers(head.fields)
        model = None if method != b"POST" or head.is_upgrade else self.fast_model(url)
        if (
            model is not None
            and headers.content_encoding is None  # compressed: the handler inflates it
            # Without the API key: the route's 401, the body never decoded nor queued. A
            # repeated head (Connection._take_repeats) repeats an accepted one's key.
            and self.app.access.allows(headers.authorization)
        ):
            # The path as fast_model matched it.
            path = url.decode("latin-1")
            exchange = Exchange(_INFER, "POST", path, version, keep_alive, head.arrival_s)
            exchange.model, exchange.header_length = model, headers.header_length
            accept = headers.accept_encoding
            exchange.encoding = None if accept is None else response_encoding(accept)
            exchange.expects_continue = head.expects_continue
            self.admit(conn, exchange, declared_length(headers.content_length))
            return exchange
        request = _request(method, url, headers, head.arrival_s)
        exchange = Exchange(
            _ROUTE, request.method, url.decode("latin-1"), version, keep_alive, head.arrival_s
        )
        exchange.request = request
        exchange.expects_continue = head.expects_continue
        self._route(exchange, request)
        return exchange

    def fast_model(self, url: bytes) -> ServedModel | None:
        """The model when ``POST url`` is an infer call its batcher answers, else None."""
        routes = self.app.infer_routes
        model = routes.get(url)
        if model is None:
            model = infer_model(self.app.repository, self.app.access, url)
            if model is None:
                return None
            routes[url] = model
        batcher = model.batcher  # None for a generation model: its engine answers
        is_fast = model.infer is None and batcher is not None and batcher.is_running
        return model if is_fast else None

    def admit(self, conn: ConnectionPort, exchange: Exchange, declared: int | None) -> None:
        """A fast-path exchange whose head is complete, its body ``declared`` bytes long
        (None: chunked): a declared length over the limit is a 413 in its turn, without
        reading the body (nor asking for it with 100 Continue); a full queue or byte
        budget, a refusal once its body is in; else its bytes are held."""
        app, model = self.app, exchange.model
        assert model is not None, "an infer exchange names its model"
        if declared is not None and declared > app.max_body_bytes:
            exchange.size_bytes, exchange.is_too_large = declared, True
            exchange.keep_alive = exchange.keeps_body = False
            return
        # Pipelined behind requests of its own connection, it reaches the queue only once
        # they are answered: the queues as they are now say nothing of its turn (they
        # hold those very requests), so the batcher judges it then. Its body is read,
        # within the byte budget like any other.
        refusal = None if conn.num_ahead else self.early_refusal(conn, model)
        if refusal is None and declared and not exchange.hold(declared, app.inflight):
            refusal = self.overloaded()
        if refusal is not None:
            exchange.head_answer, exchange.keeps_body = refusal, False

    def _route(self, exchange: Exchange, request: HttpRequest) -> None:
        """What the router makes of a request: an error answered in its turn, or its
        route, and the body it reads held in the budget."""
        app = self.app
        try:
            exchange.route = found = route(app.repository, app.access, request)
        except Exception as exc:
            self._refuse_from_head(exchange, exc)
            return
        if not found.reads_body:
            exchange.keeps_body = False
            return
        too_large = declared_too_large(request.headers.content_length, app.max_body_bytes)
        if too_large is not None:
            self._refuse_from_head(exchange, too_large)
            return
        declared = declared_length(request.headers.content_length)
        if declared and not exchange.hold(declared, app.inflight):
            exchange.head_answer, exchange.keeps_body = self.over_budget(exchange), False

    def _refuse_from_head(self, exchange: Exchange, error: Exception) -> None:
        exchange.error, exchange.keeps_body = error, False
        if getattr(error, "is_unread", False):  # the rest of the body is left unread:
            exchange.keep_alive = False  # the connection cannot carry another request

    # -- refusals prepared once --------------------------------------------------------

    def early_refusal(self, conn: ConnectionPort, model: ServedModel) -> Answer | None:
        """The answer for a request refused from its head, or None: when every queue of
        the model is at its bound, a 429 prepared once per message, without reading or
        decoding the body (under overload, refusing must cost far less than serving)."""
        batcher = model.batcher
        assert batcher is not None  # a model on the fast path
        if conn.room is _HAS_PLACE:  # it waited for this room: the waiting ones after
            conn.room = _OUT  # it do not count
            num_reserved = 0
            self.app.waiting_room.take_place(batcher)
        else:
            num_reserved = self.app.waiting_room.num_waiting_for(batcher)
        error = batcher.refuse_early(num_reserved)
        return None if error is None else self.prepared(error)

    def overloaded(self) -> Answer:
        return self.prepared(over_inflight_bytes(self.app.limits))

    def over_budget(self, exchange: Exchange) -> Answer:
        """The 503 for ``exchange``, its body past what ``--max-inflight-bytes`` leaves."""
        if exchange.kind is _INFER:
            return self.overloaded()
        error = over_inflight_bytes(self.app.limits)
        return error_response(error, is_openai=exchange.is_openai)

    def prepared(self, error: Exception) -> Answer:
        """The answer to ``error``, built once per message."""
        message = str(error)
        answer = self._refusals.get(message)
        if answer is None:
            if len(self._refusals) >= MAX_PREPARED_REFUSALS:
                self._refusals.clear()
            answer = self._refusals[message] = error_response(error)
        return answer

    def wait_for_room(self, conn: ConnectionPort, model: ServedModel, status: int) -> None:
        """After a 429 (every queue of ``model`` full), read no more of this connection
        until the model has room: a client retrying at once would otherwise be read and
        refused again and again, on the CPU the model needs."""
        if status != 429 or conn.room is _WAITING or conn.is_closing():
            return
        conn.room = _WAITING
        conn.pause_reading()
        assert model.batcher is not None  # a model on the fast path
        self.app.waiting_room.wait(model.batcher, functools.partial(self._room_made, conn))

    @staticmethod
    def _room_made(conn: ConnectionPort, has_place: bool) -> bool:
        conn.room = _OUT
        if conn.is_closing():
            return False
        if has_place:
            conn.room = _HAS_PLACE
        conn.resume_reading()
        return True

    # -- an exchange's turn --------------------------------------------------------------

    def begin(self, conn: ConnectionPort, exchange: Exchange) -> None:
        """The answers before ``exchange`` are written: its turn."""
        if conn.is_closing():
            return
        exchange.is_started = True
        if exchange.kind is _REFUSAL:
            conn.write_refusal(exchange.refusal)
        elif exchange.is_too_large:
            self.answer_too_large(conn, exchange)
        elif exchange.error is not None:
            conn.answer(exchange, *self._error_answer(exchange, exchange.error))
        elif exchange.is_received:  # pipelined: read in full while the one before it ran
            self.received(conn, exchange)
        elif exchange.route is not None and not exchange.route.reads_body:
            self._run_route(conn, exchange)  # its body, if any, is read and dropped
        elif exchange.expects_continue:
            exchange.expects_continue = False
            conn.send_continue()

    def received(self, conn: ConnectionPort, exchange: Exchange) -> None:
        """``exchange``, in its turn, is received in full: answer it."""
        answer = exchange.head_answer
        if answer is not None:
            conn.answer(exchange, *answer)
            if exchange.model is not None:
                self.wait_for_room(conn, exchange.model, answer[0])
        elif exchange.kind is _INFER:
            self.infer(conn, exchange, exchange.take())
        elif exchange.task is None:  # not already running (a route that reads no body)
            self._run_route(conn, exchange)

    def answer_too_large(self, conn: ConnectionPort, exchange: Exchange) -> None:
        error = exchange.too_large(self.app.max_body_bytes)
        conn.answer(exchange, *error_response(error, is_openai=exchange.is_openai))

    def _error_answer(self, exchange: Exchange, error: Exception) -> Answer:
        if getattr(error, "is_unread", False):
            exchange.keep_alive = False
        return error_response(error, is_openai=exchange.is_openai)

    # -- the fast path -----------------------------------------------------------------

    def infer(self, conn: ConnectionPort, exchange: Exchange, body: bytes) -> None:
        """Decode, check and queue a request received in full: ``body``, from its chunks
        or straight from the read (a repeat)."""
        model = exchange.model
        assert model is not None, "an infer exchange names its model"
        try:
            call = prepare_infer(model, body, exchange.header_length, self.app.plans)
            options = call.plan.options
            batcher = model.batcher
            assert batcher is not None  # a model on the fast path
            queued = batcher.enqueue_many(call.payload, **options, arrival_s=exchange.arrival_s)
        except Exception as exc:
            conn.answer(exchange, *error_response(exc))
            return
        exchange.call, exchange.queued = call, queued
        conn.running = exchange
        queued.future.add_done_callback(functools.partial(self._landed, conn, exchange))

    @staticmethod
    def _landed(conn: ConnectionPort, exchange: Exchange, future: asyncio.Future[Any]) -> None:
        exchange.queued = None
        # Its answer may have landed with the connection lost before this callback ran.
        if future.cancelled() or conn.state is _CLOSED:
            return
        model, call = exchange.model, exchange.call
        assert model is not None and call is not None
        try:
            error = future.exception()
            if error is not None:
                raise error
            answer = infer_response(model, call, model.outputs_of(future.result()))
        except Exception as exc:
            answer = error_response(exc)
        if exchange.encoding is not None:
            answer = compressed(answer, exchange.encoding)
        conn.answer(exchange, *answer)

    # -- other routes --------------------------------------------------------------------

    def _run_route(self, conn: ConnectionPort, exchange: Exchange) -> None:
        """Answer ``exchange`` by its route's handler, in a task: cancelled when the
        connection is lost (its model's queued request is then withdrawn)."""
        task = conn.loop.create_task(self._answer_route(conn, exchange))
        exchange.task = task
        conn.running = exchange
        tasks = conn.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _answer_route(self, conn: ConnectionPort, exchange: Exchange) -> None:
        request, found = exchange.request, exchange.route
        assert request is not None and found is not None, "a route exchange is routed"

        def watch(work: Awaitable[T]) -> Awaitable[T]:
            return _watched(conn, exchange, work)

        try:
            answer = await respond(self.app, Call(found, request, exchange.take(), watch))
        except Exception as exc:
            answer = self._error_answer(exchange, exc)
        if isinstance(answer, Stream):
            await _watched(conn, exchange, conn.stream(exchange, answer))
        else:
            conn.answer(exchange, *answer)


async def _watched(conn: ConnectionPort, exchange: Exchange, work: Awaitable[T]) -> T:
    """Await a model's ``work`` for ``exchange``: the connection's loss cancels the task
    now (its queued request is withdrawn). Lost already, the work begins and is then
    cancelled, as a watcher of the disconnect would: the model saw the request, and counts
    its abort."""
    task = exchange.task
    assert task is not None, "run in the exchange's task"
    exchange.is_watched = True
    if conn.state is _CLOSED:
        conn.loop.call_soon(task.cancel)
    try:
        return await work
    finally:
        exchange.is_watched = False


def _request(method: bytes, url: bytes, headers: RequestHeaders, arrival_s: float) -> HttpRequest:
    """The request as handlers read it: the path percent-decoded, without the query.

    Raises:
        Refused: the request target is not a URL path (400).
    """
    try:
        parsed = httptools.parse_url(url)
        path = parsed.path.decode("ascii")
    except (httptools.HttpParserInvalidURLError, AttributeError, UnicodeDecodeError):
        raise Refused(
            400, "invalid HTTP/1.1 request: the request target is not a valid URL path"
        ) from None
    if "%" in path:
        path = urllib.parse.unquote(path)
    return HttpRequest(method.decode("ascii"), path, parsed.query or b"", headers, arrival_s)
