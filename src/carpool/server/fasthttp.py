"""KServe inference over HTTP/1.1 without a task per request.

uvicorn's httptools protocol runs every request as an ASGI task: a scope, a cycle with
its event, a task, the app's awaits, a watcher for disconnects and two writes. On one core
shared with the model that path cost about 145 µs of CPU per W1 request
(`docs/benchmarks.md`). :class:`InferProtocol` is that protocol with one route taken out
of ASGI::

    POST /v2/models/{m}[/versions/{v}]/infer   (models answered by their batcher)

The parser's callbacks collect its body; it is decoded and checked on the spot
(:mod:`carpool.server.infer`), queued with :meth:`Batcher.enqueue_many`, and the answer is
written in one ``transport.write`` from the future's done-callback. A connection lost while
the request is queued withdraws it: the model never sees it. Everything else — other
routes, other models, paths with a query or escapes, upgrades — is uvicorn's own path into
:class:`KServeApp`, which answers with the same decoder, encoder and error mapping.

A fast request stands in uvicorn's ``self.cycle`` as a
:class:`~carpool.server.cycles.FastCycle`, which has the attributes uvicorn's protocol
reads there, so keep-alive, pipelining, flow control and graceful shutdown stay uvicorn's.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from carpool.server import uvicorn_contract
from carpool.server.app import KServeApp, declared_length
from carpool.server.cycles import FastCycle, Refusal
from carpool.server.encoding import response_encoding
from carpool.server.errors import NotFound, PayloadTooLarge
from carpool.server.heads import AnswerHeads, RepeatedHead, repeated_head
from carpool.server.infer import (
    Headers,
    compressed,
    error_response,
    infer_response,
    prepare_infer,
)
from carpool.server.limits import over_connections, over_inflight_bytes
from carpool.server.repository import ServedModel

_HEADER_LENGTH = b"inference-header-content-length"
_CONTENT_LENGTH = b"content-length"
_CONTENT_ENCODING = b"content-encoding"
_ACCEPT_ENCODING = b"accept-encoding"
_AUTHORIZATION = b"authorization"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# The probes the protocol answers itself, each with whether it asks for readiness.
_HEALTH = {b"/v2/health/live": False, b"/v2/health/ready": True}
# Pipelined requests read ahead of the one being answered before reading pauses. Reading
# on is how a hang-up is seen: a paused transport never reports one, and the queued
# request would reach the model for nobody.
READ_AHEAD_REQUESTS = 16
READ_AHEAD_BYTES = 1024 * 1024
# A request's head (request line and header fields) is held in memory until it is
# complete. Past MAX_HEAD_BYTES received without it ending (or trailer fields without
# the body ending) it is refused, 414 or 431, and the connection closed; a head that
# arrives within one read of the socket (at most 256 KiB) is parsed whole and then held
# to the same limits (a target under MAX_HEAD_BYTES, a head within it, MAX_HEADER_FIELDS).
# Trailer fields are never kept.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 256
# A connection closed while its client may still be sending its body (a 413 before the
# body was read) is half-closed instead: the answer goes out with a FIN,
# and what the client goes on sending is read and dropped for at most LINGER_S, until it
# closes its side. Closed at once, the kernel would answer those bytes with a reset, and a
# client still writing its body would see "connection reset" instead of the answer
# (nginx's lingering close, 5 s as its lingering_timeout).
LINGER_S = 5.0


class _Refused(Exception):
    """Raised from a parser callback: answer ``status`` with ``message`` and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def protocol_for(app: KServeApp) -> type[HttpToolsProtocol]:
    """The uvicorn ``http`` protocol class serving ``app`` with the infer fast path.

    Raises:
        ConfigError: when the installed uvicorn lacks what the fast path extends
            (:mod:`carpool.server.uvicorn_contract`).
    """
    uvicorn_contract.check()
    shared = {"kserve": app, "answer_heads": AnswerHeads(), "refusals": {}}
    return type("InferProtocol", (InferProtocol,), shared)


class InferProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; ``POST .../infer`` for batched models skips ASGI."""

    kserve: KServeApp  # set by protocol_for
    answer_heads: AnswerHeads  # shared by the connections, set by protocol_for
    refusals: dict[str, tuple[int, bytes, Headers]]  # prepared early refusals, likewise

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inflight: FastCycle | None = None
        self._held: tuple[FastCycle, bytes, int] | None = None  # waiting for resume_writing
        self._asgi: Any = None  # the ASGI cycle last started (its task may still run)
        # What guards the connection against clients that send too much or too little:
        self._receiving = False  # between a request's first byte and its last
        self._head_done = False  # the request being received has its head complete
        self._progress = False  # data_received's feed completed a head, body or message
        self._stalled_bytes = 0  # bytes received since the parser last made progress
        # The wait timed by timeout_keep_alive ends at _wait_deadline (None: no wait, the
        # server's turn); one loop timer, _wait_timer, catches up with it (_arm_timeout).
        self._wait_deadline: float | None = None
        self._wait_timer: asyncio.TimerHandle | None = None
        # Heads taken without the parser (carpool.server.heads): the last fast-path head
        # of this connection; _chunk, a read fed to the parser between two messages, and
        # _first, that read while its first message is parsed, the one whose head is kept.
        self._repeat: RepeatedHead | None = None
        self._chunk: bytes | None = None
        self._first: bytes | None = None
        self._refused = False  # bytes that cannot start a request came: read no more
        # Half-closed after an answer while the client was still sending (close_lingering):
        # closing in all but name, so nothing read, parsed or queued is acted on.
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # header field bytes of the head being received
        # When the read being parsed came, and so the first byte of a request it begins:
        # a request's deadline (timeout_s) counts from then.
        self._read_s = 0.0
        self._arrival_s = 0.0
        # Past the server's --max-connections: its first request is refused (503).
        self._over_capacity = False
        self._in_room = False  # not read until its model has room (server/waiting.py)
        self._has_place = False  # let out of it: its next request has a place kept
        # When the body of the request being received must be in (--body-timeout-s),
        # on the loop's clock; None between requests.
        self._body_deadline: float | None = None

    # -- connection limits: head size, timeouts -----------------------------------------
    #
    # uvicorn's httptools protocol buffers a request head for as long as it grows, and times
    # nothing but the keep-alive wait after an answer. Here a connection must progress:
    # while no request of it is being answered, the head of the next one must be complete
    # within timeout_keep_alive of the wait's start (connecting counts as an answer), and
    # a body must not stall for longer than that between two reads.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.server_state.connections) > self.kserve.limits.max_connections:
            self._over_capacity = True
        self._arm_timeout()  # a connection that never sends a request is closed

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what follows bad bytes cannot be trusted to start a request, nor
            # anything a lingering connection receives
        self._progress = False  # the repeats taken are progress, as parsed messages are
        self._read_s = time.monotonic()
        repeat = self._repeat
        if repeat is not None and not self._receiving and data.startswith(repeat.head):
            data = self._take_repeats(repeat, data)
            if not data:
                return
        self._chunk = None if self._receiving else data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # carpool serves no websocket (uvicorn runs with ws="none"): the request is
            # answered as plain HTTP/1.1, and, unlike uvicorn's, without two WARNING
            # lines per request that anyone could fill the log with.
            return
        except httptools.HttpParserError as error:
            refused = error.__context__
            if isinstance(refused, _Refused):
                self.logger.warning("Refused HTTP request: %s", refused)
                self._refuse(refused.status, str(refused))
            else:
                self.logger.warning("Invalid HTTP request received: %s", error)
                self._refuse(400, f"invalid HTTP/1.1 request: {error}")
            return
        if self._progress:
            self._stalled_bytes = 0
        elif self._receiving:
            # A head, chunk framing or trailer fields growing without an end: httptools
            # keeps a field's name and value whole until it ends.
            self._stalled_bytes += len(data)
            if self._stalled_bytes > MAX_HEAD_BYTES:
                status, message = self._too_large(self._stalled_bytes)
                self.logger.warning("Refused HTTP request: %s", message)
                self._refuse(status, message)
                return
        if self._receiving and self._head_done and not self._is_closing():
            self._arm_timeout()  # a body: the client must go on sending it

    def _too_large(self, size: int) -> tuple[int, str]:
        """The status and message for a head, or trailer fields, grown past the limit
        without ending: 414 while it is the request target that grows."""
        if not self._head_done and not self.headers and len(self.url) * 2 >= size:
            return 414, (
                f"request target of over {len(self.url)} bytes exceeds the limit of "
                f"{MAX_HEAD_BYTES} bytes"
            )
        what = "trailer fields" if self._head_done else "request line and header fields"
        return 431, f"{what} of over {size} bytes exceed the limit of {MAX_HEAD_BYTES} bytes"

    def on_header(self, name: bytes, value: bytes) -> None:
        # What uvicorn's does, without calling it: a super() call per field was a
        # measurable share of a request's time. Field names are matched lowercase; llhttp
        # leaves the optional whitespace after a value (RFC 9110 5.5), dropped here.
        if self._head_done:
            return  # a trailer field: never merged into the head (RFC 9110 6.5.1)
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _arm_timeout(self) -> None:
        """Start a wait of timeout_keep_alive. Lazily: uvicorn arms a loop timer for every
        answer and cancels it at the next request (1.3 us a request with uvloop, a
        measurable share); here a wait only moves the deadline, and the one timer, when it
        fires, sleeps on to the deadline of the wait then running, if any."""
        deadline = self.loop.time() + self.timeout_keep_alive
        body_deadline = self._body_deadline
        if body_deadline is not None and body_deadline < deadline:
            deadline = body_deadline  # the whole body's time runs out first
        self._wait_deadline = deadline
        if self._wait_timer is None:
            self._wait_timer = self.loop.call_at(deadline, self._wait_timer_fired)

    def _unset_keepalive_if_required(self) -> None:
        self._wait_deadline = None  # the wait is over; the timer, if armed, finds none

    def _wait_timer_fired(self) -> None:
        self._wait_timer = None
        deadline = self._wait_deadline
        if deadline is None:
            return
        # A millisecond early is on time: libuv's timers count whole milliseconds.
        if self.loop.time() + 0.001 < deadline:  # a later wait than the one armed for
            self._wait_timer = self.loop.call_at(deadline, self._wait_timer_fired)
            return
        self._wait_deadline = None
        self.timeout_keep_alive_handler()

    def on_response_complete(self) -> None:
        # uvicorn's, once per answer (no super() lookup), with the wait armed lazily.
        self.server_state.total_requests += 1
        if self._lingering or self.transport.is_closing():  # _is_closing, inline: per answer
            return
        self._wait_deadline = None
        self.flow.resume_reading()
        if not self.pipeline:
            self._arm_timeout()
            return
        cycle, app = self.pipeline.pop()
        self._start_asgi_task(cycle, app)
        # uvicorn's resumes reading after every answer: with READ_AHEAD_REQUESTS still
        # waiting, each answer let another read's worth of requests (thousands) in.
        if self.pipeline:
            self._limit_read_ahead()
        # uvicorn's arms no wait when it starts a pipelined request: a body still
        # arriving must go on arriving all the same.
        if self._receiving and self._head_done:
            self._arm_timeout()

    def _is_answering(self) -> bool:
        """A request is received in full and not yet answered: the server's turn."""
        cycle: Any = self.cycle
        if self.pipeline:
            return True
        return cycle is not None and not cycle.response_complete and not cycle.more_body

    def timeout_keep_alive_handler(self) -> None:
        if self._is_closing() or self._is_answering() or self.flow.read_paused:
            return  # the answer's on_response_complete arms the timer again
        if not self._receiving:
            self.transport.close()  # idle: closed without a word, as uvicorn does
            return
        body_deadline = self._body_deadline
        if (
            self._head_done
            and body_deadline is not None
            and self.loop.time() + 0.001 >= body_deadline
        ):
            timeout_s = self.kserve.limits.body_timeout_s
            self._refuse(
                408,
                f"the request body did not arrive in full within {timeout_s} s of its head "
                "(carpool serve --body-timeout-s)",
            )
            return
        what = "body" if self._head_done else "head"
        self._refuse(
            408, f"the request {what} did not arrive in full within {self.timeout_keep_alive} s"
        )

    def _refuse(self, status: int, message: str) -> None:
        """An error answer about the connection's bytes, then close it: what follows in
        the stream cannot be trusted to start a request. Requests received before the bad
        bytes are answered first, in order; the refusal waits in the pipeline for its turn.
        The request whose body the bad bytes cut short gets the refusal as its answer."""
        if self._refused or self._is_closing():
            return
        self._refused = True
        body = orjson.dumps({"error": message})
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body))
        if status == 503:  # a server limit: the client may come back
            parts.append(b"retry-after: 1\r\n")
        parts += (b"connection: close\r\n\r\n", body)
        answer = b"".join(parts)
        cycle: Any = self.cycle
        pipeline: Any = self.pipeline  # uvicorn's holds its own cycles; here one waits
        if self._receiving and self._head_done:  # the bad bytes are in this cycle's body
            if pipeline and pipeline[0][0] is cycle:
                pipeline.popleft()  # not started: the refusal takes its turn
                pipeline.appendleft((Refusal(answer), self.app))
                return
        elif cycle is not None and not cycle.response_complete:  # a request before the head
            pipeline.appendleft((Refusal(answer), self.app))
            return
        self._write_refusal(answer)

    def _is_closing(self) -> bool:
        return self._lingering or self.transport.is_closing()

    def _write_refusal(self, answer: bytes) -> None:
        if not self._is_closing():
            self.transport.write(answer)
            self.transport.close()  # at once: bytes that broke the protocol, not a body

    def close_lingering(self) -> None:
        """Close the connection after what was written; half-closed for LINGER_S when
        the client may still be sending the request being received."""
        transport = self.transport
        if self._is_closing():
            return
        if not self._receiving or not _can_write_eof(transport):
            transport.close()
            return
        # From here on the connection is closing (_is_closing): the rest of the read being
        # parsed, requests pipelined behind, the keep-alive wait are all left alone.
        self._lingering = self._refused = True
        self._wait_deadline = None
        self.pipeline.clear()
        transport.write_eof()  # after what is buffered
        self.flow.resume_reading()  # a paused transport would never see the client close
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    # -- parser callbacks: the fork between the fast path and uvicorn's -----------------

    def on_message_begin(self) -> None:
        # The keep-alive timer, if armed, stays: it is now the deadline for this head.
        self._receiving, self._head_done = True, False
        self._body_deadline = None
        self._arrival_s = self._read_s
        self._first, self._chunk = self._chunk, None  # the read's first message only
        # The ASGI scope is built only for requests that take the ASGI path.
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._progress = True
        self._take_head()
        # Only now: a head refused above (431, or a 400 from uvicorn's own checks) made
        # no cycle, and _refuse must not take the bad bytes for the previous one's body.
        self._head_done = True
        self._body_deadline = self.loop.time() + self.kserve.limits.body_timeout_s

    def _take_head(self) -> None:
        """The head is complete: a fast-path cycle for it, or uvicorn's ASGI one."""
        if len(self.headers) > MAX_HEADER_FIELDS:
            raise _Refused(
                431, f"request line and header fields: over {MAX_HEADER_FIELDS} fields, the limit"
            )
        # The same limits whether the head came in one read or in many (a head still
        # growing past them across reads is refused in data_received). A target of 64 KiB
        # or more is also past what httptools' URL parser can take (16-bit offsets).
        if len(self.url) >= MAX_HEAD_BYTES:
            raise _Refused(
                414,
                f"request target of {len(self.url)} bytes exceeds the limit of "
                f"{MAX_HEAD_BYTES - 1} bytes",
            )
        head_bytes = len(self.url) + self._head_bytes
        if head_bytes > MAX_HEAD_BYTES:
            raise _Refused(
                431,
                f"request line and header fields of {head_bytes} bytes exceed the limit of "
                f"{MAX_HEAD_BYTES} bytes",
            )
        if self._over_capacity:
            raise _Refused(503, str(over_connections(self.kserve.limits)))
        self._wait_deadline = None  # the request is read on (or answered)
        if self._lingering:
            return  # parsed from the read that brought the body left unread: ignored
        if self._take_health():
            return
        model = self._fast_model()
        header_length = accept = declared = authorization = None
        if model is not None:
            for name, value in self.headers:
                if name == _HEADER_LENGTH:
                    if header_length is None:  # the first, as the ASGI path reads it
                        header_length = value
                elif name == _ACCEPT_ENCODING:
                    if accept is None:  # the first, as the ASGI path reads it
                        accept = value
                elif name == _CONTENT_LENGTH:  # one at most: llhttp refuses two
                    declared = value
                elif name == _CONTENT_ENCODING:  # compressed: the ASGI path inflates it
                    model = None
                    break
                elif name == _AUTHORIZATION and authorization is None:  # the first, as ASGI
                    authorization = value
            # Without the API key: the ASGI path's 401, the body never decoded nor queued.
            # A repeated head (_take_repeats) repeats an accepted one's key byte for byte.
            if not self.kserve.access.allows(authorization):
                model = None
        if model is None:
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # uvicorn's scope, with what the parser gave so far
            self.url, self.expect_100_continue = url, expect
            self.headers.extend(headers)
            existing = self.cycle
            super().on_headers_complete()
            if self.cycle is not existing:  # not an upgrade: a cycle, whose answer may
                # close the connection before the body is read (a 413)
                self.cycle.transport = _LingeringClose(self)  # type: ignore[assignment]
            return
        if self._is_closing():
            self._first = None
            return  # after a 413 or connection: close, the rest of the read is ignored
        parser = self.parser
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive()
        encoding = None if accept is None else response_encoding(accept)
        expect = self.expect_100_continue
        # A declared length over the limit: a 413 in its turn, without reading the body
        # (nor asking for it with 100 Continue).
        size = declared_length(declared)
        too_large = size if size is not None and size > self.kserve.max_body_bytes else 0
        self._start_fast(
            model, header_length, encoding, version, keep_alive, expect, too_large, size or 0
        )
        if not keep_alive or expect:
            self._first = None  # not kept: the parser tracks what such heads ask

    def _start_fast(
        self,
        model: ServedModel,
        header_length: bytes | None,
        encoding: bytes | None,
        version: str,
        keep_alive: bool,
        expect_continue: bool,
        too_large: int = 0,
        declared: int = 0,
    ) -> None:
        """A fast-path request whose head is complete: answered now, or queued behind
        the request being answered. ``too_large``: the body's declared length, over the
        limit (0: not over); ``declared``: its declared length (0: none)."""
        cycle = FastCycle(
            model,
            self.url.decode("latin-1"),  # as _fast_model matched it
            header_length,
            encoding,
            version,
            keep_alive,
            expect_continue,
            self.on_response_complete,
        )
        cycle.arrival_s = self._arrival_s
        if too_large:
            cycle.size, cycle.oversize, cycle.keep_alive = too_large, True, False
        else:
            cycle.head_answer = self._early_refusal(model)
            if cycle.head_answer is None and declared:
                self._hold(cycle, declared)
        self._schedule(cycle)

    def _schedule(self, cycle: FastCycle) -> None:
        """Begin ``cycle`` now, or queue it behind the request still being answered."""
        existing, self.cycle = self.cycle, cycle  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._begin(cycle)
        else:  # pipelined behind a request still being answered
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]
            self._limit_read_ahead()

    def _take_health(self) -> bool:
        """``GET /v2/health/live`` or ``/ready``, answered by the protocol itself (no
        ASGI task): under overload a probe must not wait behind the tasks of request
        handling, or a kubelet would restart a server that is only busy."""
        asks_ready = _HEALTH.get(self.url)
        if asks_ready is None or self.parser.get_method() != b"GET" or self._is_closing():
            return False
        parser = self.parser
        version = parser.get_http_version()
        keep_alive = version != "1.0" and parser.should_keep_alive()
        path = self.url.decode("latin-1")
        no_model: Any = None  # a probe names none; nothing reads it for an answer set here
        cycle = FastCycle(
            no_model, path, None, None, version, keep_alive, False, self.on_response_complete
        )
        is_ready = not asks_ready or self.kserve.repository.is_ready
        cycle.head_answer = (200, b"", ()) if is_ready else (503, b"", ())
        self._first = None
        self._schedule(cycle)
        return True

    def on_body(self, body: bytes) -> None:
        self._progress = True
        cycle = self.cycle
        if not isinstance(cycle, FastCycle):
            super().on_body(body)
            return
        if cycle.response_complete or cycle.oversize or cycle.head_answer is not None:
            return  # too large, or refused from its head: the body is ignored
        cycle.chunks.append(body)
        cycle.size += len(body)
        if cycle.size > cycle.held:  # chunked: no length was declared to hold
            self._hold(cycle, cycle.size - cycle.held)
            if cycle.head_answer is not None:
                cycle.chunks = []
                return
        if not cycle.started:
            self._limit_read_ahead()
        limit = self.kserve.max_body_bytes
        if cycle.size > limit:
            cycle.keep_alive = False  # the unread rest makes the connection unusable
            cycle.chunks = []
            # Answered now, or (pipelined) in its turn after the requests before it; either
            # way the rest of the body is ignored and never decoded, also while the 413 is
            # held for resume_writing.
            cycle.oversize = True
            if cycle.started:
                self._answer_too_large(cycle)

    def on_message_complete(self) -> None:
        self._receiving, self._progress = False, True
        self._body_deadline = None
        self._wait_deadline = None  # a body's wait; the answer starts the next
        cycle = self.cycle
        if not isinstance(cycle, FastCycle):
            super().on_message_complete()
            return
        cycle.more_body = False
        first, self._first = self._first, None
        if first is not None and not cycle.oversize and cycle.head_answer is None:
            self._keep_head(first, cycle)
        if cycle.started and not cycle.response_complete and not cycle.oversize:
            self._dispatch_received(cycle)

    # -- repeated heads -----------------------------------------------------------------

    def _keep_head(self, chunk: bytes, cycle: FastCycle) -> None:
        """Keep the head of ``cycle``, the first message parsed from ``chunk``, when it
        can be taken again without the parser."""
        body, url, headers = b"".join(cycle.chunks), self.url, self.headers
        encoding, version = cycle.encoding, cycle.http_version
        repeat = repeated_head(chunk, url, headers, body, cycle.header_length, encoding, version)
        if repeat is not None:
            self._repeat = repeat

    def _take_repeats(self, repeat: RepeatedHead, data: bytes) -> bytes:
        """Take the whole requests at the start of ``data`` that repeat ``repeat``'s head,
        as the parser's callbacks would; what is left is for the parser (a request cut
        short by the read, or another one)."""
        head, size, url = repeat.head, repeat.size, repeat.url
        start, length, step = 0, len(data), len(head) + size
        kserve, transport = self.kserve, self.transport
        fits = size <= kserve.max_body_bytes
        while True:
            end = start + step
            if end > length or not data.startswith(head, start):
                break
            model = kserve.infer_routes.get(url)
            if (
                model is None
                or model.infer is not None
                or model.batcher is None  # a generation model: its engine answers
                or not model.batcher.is_running
            ):
                break  # the parser's path decides, as for the first such request
            if transport.is_closing() or self._lingering:  # as _is_closing, inline
                return b""  # after a 413: the rest of the read is ignored
            existing = self.cycle
            if fits and (existing is None or existing.response_complete):
                refusal = self._early_refusal(model)
                if refusal is None and size and not self.kserve.inflight.take(size):
                    refusal = self._overloaded()
                # Nothing before it on the connection: received, begun and dispatched in
                # one step, leaving what _start_fast, on_body and on_message_complete would.
                self._receiving, self._head_done, self._progress = False, True, True
                self._wait_deadline, self._first = None, None
                self.url, self.headers, self.expect_100_continue = url, [], False
                cycle = FastCycle(
                    model,
                    repeat.path,
                    repeat.header_length,
                    repeat.encoding,
                    repeat.http_version,
                    True,
                    False,
                    self.on_response_complete,
                )
                cycle.size, cycle.more_body, cycle.started = size, False, True
                cycle.held = size if refusal is None else 0
                cycle.arrival_s = self._read_s
                self.cycle = cycle  # type: ignore[assignment]
                if refusal is not None:
                    self._answer(cycle, *refusal)
                    self._wait_for_room(model, refusal[0])
                else:
                    self._dispatch(cycle, data[end - size : end])
                start = end
                continue
            self._receiving = self._head_done = True
            self._arrival_s = self._read_s
            self._wait_deadline, self._first = None, None
            self.url, self.headers, self.expect_100_continue = url, [], False
            header_length, encoding = repeat.header_length, repeat.encoding
            version = repeat.http_version
            self._start_fast(model, header_length, encoding, version, True, False, 0, size)
            if size:
                self.on_body(data[end - size : end])
            self.on_message_complete()
            start = end
        if start:
            self._stalled_bytes = 0
        return data[start:] if start else data

    def _limit_read_ahead(self) -> None:
        """Pause reading once the pipelined requests waiting hold READ_AHEAD_REQUESTS or
        READ_AHEAD_BYTES. Constant time: it runs for every request a read brings, and one
        read can bring thousands (a scan of the pipeline each time stalled the loop for
        seconds, long enough for other connections' keep-alive timers to fire)."""
        pipeline = self.pipeline
        if len(pipeline) >= READ_AHEAD_REQUESTS:
            self.flow.pause_reading()
            return
        waiting: list[Any] = [c for c, _ in pipeline]  # fewer than READ_AHEAD_REQUESTS
        size = sum(c.size for c in waiting if isinstance(c, FastCycle))
        if size >= READ_AHEAD_BYTES:
            self.flow.pause_reading()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # uvicorn starts the next pipelined request through here, from the answer of the
        # one before. Begun on the next loop turn: a run of pipelined requests answered on
        # the spot (400s) would otherwise begin each other recursively.
        if isinstance(cycle, FastCycle):
            self.loop.call_soon(self._begin, cycle)
        elif isinstance(cycle, Refusal):
            self.loop.call_soon(self._write_refusal, cycle.answer)
        else:
            self._asgi = cycle
            super()._start_asgi_task(cycle, app)

    def resume_writing(self) -> None:
        super().resume_writing()
        held, self._held = self._held, None
        if held is not None and not self._is_closing():
            self._finish(*held)

    def connection_lost(self, exc: Exception | None) -> None:
        for waiting in [self.cycle, self._inflight, *(c for c, _ in self.pipeline)]:
            if isinstance(waiting, FastCycle):
                self._release(waiting)  # never answered: its bytes go back to the budget
        held = self._held
        if held is not None:
            self._release(held[0])
        cycle = self._inflight
        if cycle is not None:
            # Its answer may have landed with the done-callback not yet run: cancelling
            # is then too late, and uvicorn marks only the newest cycle disconnected.
            cycle.disconnected = True
            batcher = cycle.model.batcher
            if cycle.queued is not None and batcher is not None:
                batcher.cancel(cycle.queued)
                cycle.queued = None
        # uvicorn tells only the newest cycle; an ASGI request running with a pipelined one
        # behind it would go on to write to the closed transport (uvloop raises) and keep
        # its queued request in the batcher.
        asgi = self._asgi
        if asgi is not None and asgi is not self.cycle and not asgi.response_complete:
            asgi.disconnected = True
            asgi.message_event.set()
        timer, self._wait_timer, self._wait_deadline = self._wait_timer, None, None
        if timer is not None:  # not left to fire on a closed connection, holding it
            timer.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    # -- the fast path ----------------------------------------------------------------

    def _fast_model(self) -> ServedModel | None:
        """The model when this request is an infer call its batcher answers, else None."""
        if self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return None
        url = self.url
        routes = self.kserve.infer_routes
        model = routes.get(url)
        if model is None:
            model = self._route(url)
            if model is None:
                return None
            routes[url] = model
        batcher = model.batcher  # None for a generation model: its engine answers
        is_fast = model.infer is None and batcher is not None and batcher.is_running
        return model if is_fast else None

    def _route(self, url: bytes) -> ServedModel | None:
        """The served model an infer URL names, without a query or escapes (those, and
        what is not found, take the ASGI path)."""
        if b"?" in url or b"%" in url:
            return None
        parts = url.decode("latin-1").split("/")
        # ["", "v2", "models", name, "infer"] or [..., name, "versions", v, "infer"]
        if len(parts) == 5:
            version = None
        elif len(parts) == 7 and parts[4] == "versions":
            version = parts[5]
        else:
            return None
        if parts[1] != "v2" or parts[2] != "models" or parts[-1] != "infer" or "" in parts[3:]:
            return None  # an empty segment: the ASGI path's router decides (404)
        try:
            return self.kserve.repository.get(parts[3], version)
        except NotFound:
            return None  # the ASGI path answers 404 with its message

    def _begin(self, cycle: FastCycle) -> None:
        if self._is_closing():
            return
        cycle.started = True
        if cycle.oversize:
            self._answer_too_large(cycle)
        elif not cycle.more_body:  # pipelined: read in full while the one before it ran
            self._dispatch_received(cycle)
        elif cycle.waiting_for_100_continue:
            cycle.waiting_for_100_continue = False
            self.transport.write(_CONTINUE)

    def _answer_too_large(self, cycle: FastCycle) -> None:
        limit = self.kserve.max_body_bytes
        self._answer(cycle, *error_response(PayloadTooLarge(cycle.size, limit)))

    def _dispatch_received(self, cycle: FastCycle) -> None:
        if cycle.head_answer is not None:
            self._answer(cycle, *cycle.head_answer)
            self._wait_for_room(cycle.model, cycle.head_answer[0])
            return
        body, cycle.chunks = b"".join(cycle.chunks), []
        self._dispatch(cycle, body)

    def _wait_for_room(self, model: ServedModel, status: int) -> None:
        """After a 429 (every queue of ``model`` full), read no more of this connection
        until the model has room: a client retrying at once would otherwise be read and
        refused again and again, on the CPU the model needs."""
        if status != 429 or self._in_room or self._is_closing():
            return
        self._in_room = True
        self.flow.pause_reading()
        assert model.batcher is not None  # a model on the fast path
        self.kserve.waiting_room.wait(model.batcher, self._room_made)

    def _room_made(self, has_place: bool) -> bool:
        self._in_room = False
        if self._is_closing():
            return False
        self._has_place = has_place
        self.flow.resume_reading()
        return True

    def _hold(self, cycle: FastCycle, size_bytes: int) -> None:
        """Hold ``size_bytes`` more of ``cycle``'s body in the server's budget
        (``--max-inflight-bytes``), or refuse the request (503) when it would pass it."""
        if self.kserve.inflight.take(size_bytes):
            cycle.held += size_bytes
        else:
            self._release(cycle)
            cycle.head_answer = self._overloaded()

    def _release(self, cycle: FastCycle) -> None:
        if cycle.held:
            self.kserve.inflight.release(cycle.held)
            cycle.held = 0

    def _overloaded(self) -> tuple[int, bytes, Headers]:
        return self._prepared(over_inflight_bytes(self.kserve.limits))

    def _early_refusal(self, model: ServedModel) -> tuple[int, bytes, Headers] | None:
        """The answer for a request refused from its head, or None: when every queue of
        the model is at its bound, a 429 prepared once per message, without reading or
        decoding the body (under overload, refusing must cost far less than serving)."""
        batcher = model.batcher
        assert batcher is not None  # a model on the fast path
        if self._has_place:  # it waited for this room: the waiting ones after it do not count
            self._has_place = False
            num_reserved = 0
        else:
            num_reserved = self.kserve.waiting_room.num_waiting_for(batcher)
        error = batcher.refuse_early(num_reserved)
        return None if error is None else self._prepared(error)

    def _prepared(self, error: Exception) -> tuple[int, bytes, Headers]:
        """The answer to ``error``, built once per message: refusing under overload must
        cost far less than serving."""
        message = str(error)
        answer = self.refusals.get(message)
        if answer is None:
            if len(self.refusals) >= 256:  # one per model and bound, a few limits: never many
                self.refusals.clear()
            answer = self.refusals[message] = error_response(error)
        return answer

    def _dispatch(self, cycle: FastCycle, body: bytes) -> None:
        """Decode, check and queue a request received in full: ``body``, from its
        chunks or straight from the read (a repeat)."""
        model = cycle.model
        try:
            call = prepare_infer(model, body, cycle.header_length, self.kserve.plans)
            options = call.plan.options
            batcher = model.batcher
            assert batcher is not None  # a model on the fast path
            queued = batcher.enqueue_many(call.payload, **options, arrival_s=cycle.arrival_s)
        except Exception as exc:
            self._answer(cycle, *error_response(exc))
            return
        cycle.call, cycle.queued = call, queued
        self._inflight = cycle
        queued.future.add_done_callback(functools.partial(self._landed, cycle))

    def _landed(self, cycle: FastCycle, future: asyncio.Future[Any]) -> None:
        cycle.queued = None
        if future.cancelled() or cycle.disconnected:
            return
        model, call = cycle.model, cycle.call
        assert call is not None
        try:
            error = future.exception()
            if error is not None:
                raise error
            answer = infer_response(model, call, model.outputs_of(future.result()))
        except Exception as exc:
            answer = error_response(exc)
        if cycle.encoding is not None:
            answer = compressed(answer, cycle.encoding)
        self._answer(cycle, *answer)

    def _answer(self, cycle: FastCycle, status: int, body: bytes, headers: Headers) -> None:
        """Status line, headers and body in one write; then what uvicorn does after a
        response: close, or keep alive and start the next pipelined request."""
        if self._inflight is cycle:
            self._inflight = None
        defaults = self.server_state.default_headers
        head = self.answer_heads.head(defaults, status, headers, len(body), cycle.keep_alive)
        data = head + body
        if self.flow.write_paused:  # the client is not reading: hold it, read no more
            self._held = (cycle, data, status)
            return
        self._finish(cycle, data, status)

    def _finish(self, cycle: FastCycle, data: bytes, status: int) -> None:
        self._release(cycle)
        self.transport.write(data)
        cycle.response_complete = True
        if self.access_log:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            self.access_logger.info(
                '%s - "POST %s HTTP/%s" %d', client, cycle.path, cycle.http_version, status
            )
        if not cycle.keep_alive:
            self.close_lingering()
        cycle.on_response()


def _can_write_eof(transport: asyncio.Transport) -> bool:
    try:
        return transport.can_write_eof()
    except NotImplementedError:  # asyncio's base transport: no half-close
        return False


class _LingeringClose:
    """The transport an ASGI cycle writes to: the connection's, closed as
    :meth:`InferProtocol.close_lingering` closes it (uvicorn's cycle closes its transport
    when an answer ends the connection)."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: InferProtocol) -> None:
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol._is_closing()

    def write(self, data: bytes) -> None:
        if not self._protocol._is_closing():  # a half-closed transport raises
            self._protocol.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._protocol.transport, name)
