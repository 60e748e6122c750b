"""Request framing: a connection's bytes to requests, by ``httptools``' parser (its
callbacks) or, for a head the client repeats, without it (:mod:`~carpool.server.http.
repeats`). A complete head is handed to dispatch (:mod:`~carpool.server.http.dispatch`),
the body it reads is held to the limits as it comes (:mod:`~carpool.server.http.body`),
and a head past its limits (:mod:`~carpool.server.http.guards`) or bytes the parser
refuses are refused. What becomes of the requests, their order and their answers is the
connection's (:mod:`~carpool.server.http.connection`).

The state of a connection, ordered: from REFUSED on, nothing more is read::

    IDLE --first byte--> HEAD --head complete--> BODY --message complete--> IDLE
      any of them --bad bytes, a head too large, a stall--> REFUSED
      HEAD/BODY/REFUSED --an answer that closes--> LINGERING (half-closed, dropping)
      any --the transport is lost--> CLOSED
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import deque
from typing import cast

import httptools

from carpool.server.http.body import BodyCheck
from carpool.server.http.exchange import Exchange, ExchangeKind, Head
from carpool.server.http.guards import (
    MAX_HEAD_BYTES,
    WaitTimer,
    grown_head_refusal,
    head_refusal,
    host_refusal,
)
from carpool.server.http.host import Host
from carpool.server.http.refusals import Refused
from carpool.server.http.repeats import RepeatedHead, repeated_head
from carpool.server.http.states import ConnectionPort, ConnectionState
from carpool.server.infer import Headers
from carpool.server.limits import over_connections

log = logging.getLogger("carpool.server.http")


_IDLE, _HEAD, _BODY = ConnectionState.IDLE, ConnectionState.HEAD, ConnectionState.BODY
_REFUSED, _LINGERING = ConnectionState.REFUSED, ConnectionState.LINGERING
_INFER = ExchangeKind.INFER  # Enum members as module names: class attributes are slow
_TAKEN, _OVER_BUDGET = BodyCheck.TAKEN, BodyCheck.OVER_BUDGET


class Framing(asyncio.Protocol, abc.ABC):
    """Reads requests off a connection of ``server``; the rest is its subclass's
    (:class:`~carpool.server.http.connection.Connection`)."""

    def __init__(self, server: Host) -> None:
        self._server = server
        self._app = server.app
        self._dispatch = server.dispatch
        self._monotonic = server.monotonic
        self.loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        # Answer the first of pipelined requests sent with Connection: close, not a 400.
        self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self._timer: WaitTimer = None  # type: ignore[assignment]  # connection_made
        self.state = _IDLE
        # The exchanges whose head came and whose answer has not gone, in order: the
        # first's turn; _incoming, the one whose body the parser is in.
        self._queue: deque[Exchange] = deque()
        self._incoming: Exchange | None = None
        self._is_over_capacity = False  # past --max-connections: its first request a 503
        self._body_deadline: float | None = None  # --body-timeout-s, on the loop's clock
        self._progress = False  # the read being fed completed a head, body or message
        self._stalled_bytes = 0  # bytes received since the parser last made progress
        # Heads taken without the parser: the last fast-path head of this connection;
        # _chunk, a read fed to the parser between two messages, and _first, that read
        # while its first message is parsed, the one whose head is kept.
        self._repeat: RepeatedHead | None = None
        self._chunk: bytes | None = None
        self._first: bytes | None = None
        # The head being received, as the parser's callbacks give it.
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0
        self._expects_continue = False
        self._transfer_coding: bytes | None = None  # a Transfer-Encoding besides chunked
        self._hosts: list[bytes] = []  # the values of its Host fields
        # When the read being parsed came, and so the first byte of a request it begins:
        # a request's deadline (timeout_s) counts from then.
        self._read_s = 0.0
        self._arrival_s = 0.0

    # -- what the connection does with what is read ----------------------------------------

    @abc.abstractmethod
    def schedule(self, exchange: Exchange) -> None:
        """Queue ``exchange``, whose head is complete, behind the ones before it."""

    @abc.abstractmethod
    def answer(self, exchange: Exchange, status: int, body: bytes, headers: Headers) -> None:
        """Write ``exchange``'s answer in its turn."""

    @abc.abstractmethod
    def is_closing(self) -> bool:
        """Whether nothing more is to be written: lingering, or the transport closing."""

    @abc.abstractmethod
    def _refuse(self, status: int, message: str) -> None:
        """Refuse the bytes read with ``status`` in their turn, then close."""

    @abc.abstractmethod
    def _arm_wait(self) -> None:
        """Time the wait for the client's next bytes."""

    @abc.abstractmethod
    def _limit_read_ahead(self) -> None:
        """Pause reading while too much is read ahead of the answers."""

    # -- reads ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.state >= _REFUSED:
            return  # what follows bad bytes cannot be trusted to start a request, nor
            # anything a lingering connection receives
        self._progress = False  # the repeats taken are progress, as parsed messages are
        self._read_s = self._monotonic()
        repeat = self._repeat
        if repeat is not None and self.state is _IDLE and data.startswith(repeat.head):
            data = self._take_repeats(repeat, data)
            if not data:
                return
        self._chunk = data if self.state is _IDLE else None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # carpool serves no websocket: the request is answered as plain HTTP/1.1 and
            # its connection closed (keep_alive is off for it), without a log line per
            # request that anyone could fill the log with.
            return
        except httptools.HttpParserError as error:
            refused = error.__context__
            if isinstance(refused, Refused):
                log.warning("Refused HTTP request: %s", refused)
                self._refuse(refused.status, str(refused))
            elif str(error) == "Invalid HTTP version":  # llhttp: HTTP/1.2, HTTP/3.0
                log.warning("Refused HTTP request: %s", error)
                self._refuse(505, "only HTTP/1.1 and HTTP/1.0 are served here")
            else:
                log.warning("Invalid HTTP request received: %s", error)
                self._refuse(400, f"invalid HTTP/1.1 request: {error}")
            return
        if self._progress:
            self._stalled_bytes = 0
        elif _HEAD <= self.state <= _BODY:
            # A head, chunk framing or trailer fields growing without an end: httptools
            # keeps a field's name and value whole until it ends.
            self._stalled_bytes += len(data)
            if self._stalled_bytes > MAX_HEAD_BYTES:
                status, message = grown_head_refusal(
                    self._stalled_bytes, len(self._url), bool(self._fields), self.state is _BODY
                )
                log.warning("Refused HTTP request: %s", message)
                self._refuse(status, message)
                return
        if self.state is _BODY and not self.is_closing():
            self._arm_wait()  # a body: the client must go on sending it

    # -- the parser's callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.state >= _REFUSED:
            return  # the rest of a read after a closing answer: ignored
        # The wait timer, if armed, stays: it is now the deadline for this head.
        self.state = _HEAD
        self._body_deadline = None
        self._arrival_s = self._read_s
        self._first, self._chunk = self._chunk, None  # the read's first message only
        self._url = b""
        self._fields = []
        self._field_bytes = 0
        self._expects_continue = False
        self._transfer_coding = None
        self._hosts = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Names are matched lowercase; llhttp leaves the optional whitespace after a
        # value (RFC 9110 5.5), dropped here.
        if self.state is not _HEAD:
            return  # a trailer field: never merged into the head (RFC 9110 6.5.1)
        self._field_bytes += len(name) + len(value) + 4  # ": " and CRLF
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expects_continue = True
        elif name == b"transfer-encoding" and value.lower().replace(b" ", b"") != b"chunked":
            self._transfer_coding = value  # llhttp takes "gzip, chunked" as chunked
        elif name == b"host":
            self._hosts.append(value)
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        self._progress = True
        self._take_head()
        if self.state is _HEAD:  # not closed meanwhile
            self.state = _BODY
            self._body_deadline = self.loop.time() + self._app.limits.body_timeout_s

    def _take_head(self) -> None:
        refusal = head_refusal(len(self._url), self._field_bytes, len(self._fields))
        if refusal is not None:
            raise Refused(*refusal)
        if self._transfer_coding is not None:  # RFC 9112 6.1: a coding it cannot decode
            coding = self._transfer_coding.decode("latin-1")
            raise Refused(
                501,
                f"Transfer-Encoding {coding!r} is not supported: send the body chunked or "
                "with Content-Length, compressed with Content-Encoding if at all",
            )
        version = self._parser.get_http_version()
        if not version.startswith("1."):  # RFC 9110 15.6.6: another major version
            raise Refused(505, f"HTTP/{version} is not supported here; send HTTP/1.1")
        host_refused = host_refusal(version, self._hosts)
        if host_refused is not None:
            raise Refused(*host_refused)
        if self._is_over_capacity:
            raise Refused(503, str(over_connections(self._app.limits)))
        self._timer.deadline = None  # the request is read on (or answered)
        if self.is_closing():
            self._first = None
            return  # after a 413 or connection: close, the rest of the read is ignored
        parser = self._parser
        is_upgrade = parser.should_upgrade()
        keep_alive = version != "1.0" and parser.should_keep_alive() and not is_upgrade
        if version == "1.0":  # RFC 9110 10.1.1: ignored, and no 1xx to an HTTP/1.0 client
            self._expects_continue = False
        head = Head(
            parser.get_method(),
            self._url,
            self._fields,
            version,
            keep_alive,
            is_upgrade,
            self._expects_continue,
            self._arrival_s,
        )
        exchange = self._dispatch.head(cast(ConnectionPort, self), head)
        if exchange.kind is not _INFER or not keep_alive or self._expects_continue:
            self._first = None  # not kept: the parser tracks what such heads ask
        self._incoming = exchange
        self.schedule(exchange)

    def on_body(self, body: bytes) -> None:
        self._progress = True
        exchange = self._incoming
        if exchange is None or not exchange.keeps_body or self.state is not _BODY:
            return  # refused from its head, too large, or a route that reads none
        app = self._app
        check = exchange.add(body, app.max_body_bytes, app.inflight)
        if not exchange.is_started:
            self._limit_read_ahead()
        if check is _TAKEN:
            return
        exchange.keeps_body, exchange.chunks = False, []
        if check is _OVER_BUDGET:
            exchange.release(app.inflight)
            exchange.head_answer = self._dispatch.over_budget(exchange)
            return
        # Too large: answered now, or (pipelined) in its turn after the requests before
        # it; either way the rest of the body is ignored and never decoded.
        exchange.keep_alive = False  # the unread rest makes the connection unusable
        exchange.is_too_large = True
        if exchange.is_started and not exchange.is_answered:
            self._dispatch.answer_too_large(cast(ConnectionPort, self), exchange)

    def on_message_complete(self) -> None:
        self._progress = True
        if self.state >= _REFUSED:
            return
        self.state = _IDLE
        self._body_deadline = None
        self._timer.deadline = None  # a body's wait; the answer starts the next
        exchange, self._incoming = self._incoming, None
        if exchange is None:
            return
        exchange.is_received = True
        first, self._first = self._first, None
        if (
            first is not None
            and exchange.kind is _INFER
            and not exchange.is_too_large
            and exchange.head_answer is None
        ):
            self._keep_head(first, exchange)
        if exchange.is_started and not exchange.is_answered and not exchange.is_too_large:
            self._dispatch.received(cast(ConnectionPort, self), exchange)

    # -- repeated heads -----------------------------------------------------------------

    def _keep_head(self, read: bytes, exchange: Exchange) -> None:
        """Keep the head of ``exchange``, the first message parsed from ``read``, when it
        can be taken again without the parser."""
        body = b"".join(exchange.chunks)
        version, encoding = exchange.http_version, exchange.encoding
        repeat = repeated_head(
            read, self._url, self._fields, body, exchange.header_length, encoding, version
        )
        if repeat is not None:
            self._repeat = repeat

    def _take_repeats(self, repeat: RepeatedHead, data: bytes) -> bytes:
        """Take the whole requests at the start of ``data`` that repeat ``repeat``'s head,
        as the parser's callbacks would; what is left is for the parser (a request cut
        short by the read, or another one)."""
        head, size, url = repeat.head, repeat.size, repeat.url
        start, length, step = 0, len(data), len(head) + size
        app, dispatch, transport, queue = self._app, self._dispatch, self._transport, self._queue
        conn = cast(ConnectionPort, self)  # a Framing is always a Connection
        routes, inflight = app.infer_routes, app.inflight
        fits = size <= app.max_body_bytes
        while True:
            end = start + step
            if end > length or not data.startswith(head, start):
                break
            model = routes.get(url)
            if model is None or model.infer is not None:
                break  # the parser's path decides, as for the first such request
            batcher = model.batcher  # None for a generation model: its engine answers
            if batcher is None or not batcher.is_running:
                break
            if transport.is_closing() or self.state >= _REFUSED:
                return b""  # after a 413: the rest of the read is ignored
            self._url, self._first, self._progress = url, None, True
            self._timer.deadline = None
            exchange = Exchange(
                _INFER, "POST", repeat.path, repeat.http_version, True, self._read_s
            )
            exchange.model, exchange.header_length = model, repeat.header_length
            exchange.encoding = repeat.encoding
            if fits and not queue:
                # Nothing before it on the connection: received, begun and dispatched in
                # one step, leaving what the parser's callbacks and dispatch would.
                refusal = dispatch.early_refusal(conn, model)
                if refusal is None and size and not exchange.hold(size, inflight):
                    refusal = dispatch.overloaded()
                exchange.size_bytes = size
                exchange.is_received = exchange.is_started = True
                queue.append(exchange)
                if refusal is not None:
                    exchange.keeps_body = False
                    self.answer(exchange, *refusal)
                    dispatch.wait_for_room(conn, model, refusal[0])
                else:
                    dispatch.infer(conn, exchange, data[end - size : end])
                start = end
                continue
            self.state = _BODY
            self._arrival_s = self._read_s
            dispatch.admit(conn, exchange, size)
            self._incoming = exchange
            self.schedule(exchange)
            if size:
                self.on_body(data[end - size : end])
            self.on_message_complete()
            start = end
        if start:
            self._stalled_bytes = 0
        return data[start:] if start else data
