"""One HTTP/1.1 connection: carpool's own asyncio protocol on ``httptools``' parser.

Its requests are framed by :class:`~carpool.server.http.framing.Framing`; here they are
kept in order and each is handed to :mod:`~carpool.server.http.dispatch` in its turn,
and the answers are written: one write each, in order, keep-alive or closing, held while
the client does not read. Here too are the waits it times
(:mod:`~carpool.server.http.guards`), bytes refused in their turn and the lingering close
(:mod:`~carpool.server.http.refusals`), and what a lost connection withdraws.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from itertools import islice

from carpool.server.http.answer import CONTINUE, LAST_CHUNK, answer_head, chunk
from carpool.server.http.exchange import Exchange, ExchangeKind
from carpool.server.http.framing import Framing
from carpool.server.http.guards import READ_AHEAD_BYTES, READ_AHEAD_REQUESTS, WaitTimer
from carpool.server.http.handlers import Stream
from carpool.server.http.host import Host
from carpool.server.http.refusals import LINGER_S, can_write_eof, refusal_answer
from carpool.server.http.states import ConnectionState, Room
from carpool.server.infer import Headers

access_log = logging.getLogger("carpool.server.access")

_IDLE, _HEAD, _BODY = ConnectionState.IDLE, ConnectionState.HEAD, ConnectionState.BODY
_REFUSED, _LINGERING = ConnectionState.REFUSED, ConnectionState.LINGERING
_CLOSED = ConnectionState.CLOSED
_INFER, _REFUSAL = ExchangeKind.INFER, ExchangeKind.REFUSAL
_WAITING = Room.WAITING  # Enum members as module names: class attributes are slow to read


class Connection(Framing):
    """The protocol of one client connection of ``server``; ``first_read``: its first
    bytes, read by the server as it accepted the connection."""

    def __init__(self, server: Host, first_read: bytes = b"") -> None:
        super().__init__(server)
        self.tasks = server.tasks
        self._date, self._answer_heads = server.date, server.answer_heads
        self._keep_alive_s = server.timeout_keep_alive_s
        self.client: tuple[str, int] | None = None
        self.room = Room.OUT
        self._first_read = first_read
        self.running: Exchange | None = None  # queued in its batcher or its handler running
        self._held: tuple[Exchange, bytes, int] | None = None  # waiting for resume_writing
        self._drain: asyncio.Future[None] | None = None  # a stream waiting likewise
        self.is_read_paused = False
        self._unread = b""  # read while paused, until reading resumes (see data_received)
        self.is_write_paused = False
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- the transport's callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport
        peer = transport.get_extra_info("peername")
        self.client = peer[:2] if isinstance(peer, tuple) else None
        connections = self._server.connections
        connections.add(self)
        if len(connections) > self._app.limits.max_connections:
            self._is_over_capacity = True
        self._timer = WaitTimer(self.loop, self._wait_expired)
        self._arm_wait()  # a connection that never sends a request is closed
        first, self._first_read = self._first_read, b""
        if first:
            self.data_received(first)

    def data_received(self, data: bytes) -> None:
        if self.is_read_paused:
            # uvloop starts reading once connection_made returns, even when the protocol
            # paused inside it (its first request refused to the waiting room): its retries
            # were then read, and refused, while it waited. The bytes wait here instead.
            self._unread += data
            self._transport.pause_reading()
            return
        super().data_received(data)

    def eof_received(self) -> None:
        """The client's FIN: taken as gone (as uvicorn, nginx and Go's net/http take it;
        on the wire a half-close cannot be told from a close); the transport closes. With
        answer bytes it has not read yet the transport is aborted instead: a close waits
        for them to be read, which a gone client never does, so the connection was not
        lost and what it ran (a stream generating for nobody) was never cancelled."""
        if self._transport.get_write_buffer_size():
            self._transport.abort()

    def pause_writing(self) -> None:
        self.is_write_paused = True

    def resume_writing(self) -> None:
        self.is_write_paused = False
        held, self._held = self._held, None
        if held is not None and not self.is_closing():
            self._finish(*held)
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self._server.connections.discard(self)
        inflight = self._app.inflight
        for waiting in self._queue:  # never answered: their bytes go back to the budget
            waiting.release(inflight)
        for exchange in (self._incoming, self._held[0] if self._held else None):
            if exchange is not None:
                exchange.release(inflight)
        self._queue.clear()
        self._held = None
        running, self.running = self.running, None
        if running is not None:
            queued = running.queued
            batcher = None if running.model is None else running.model.batcher
            if queued is not None and batcher is not None:
                batcher.cancel(queued)  # withdrawn: the model never sees it
                running.queued = None
            if running.task is not None and running.is_watched:
                running.task.cancel()  # else it is cancelled as it starts the model's work
        if self._timer is not None:  # not left to fire on a closed connection, holding it
            self._timer.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)
        if exc is None:
            self._transport.close()

    # -- exchanges in order -------------------------------------------------------------

    @property
    def num_ahead(self) -> int:
        return len(self._queue)

    def schedule(self, exchange: Exchange) -> None:
        """Begin ``exchange`` now, or queue it behind the ones still being answered."""
        queue = self._queue
        queue.append(exchange)
        if len(queue) == 1:
            self._dispatch.begin(self, exchange)
        else:
            self._limit_read_ahead()

    def _begin(self, exchange: Exchange) -> None:
        self._dispatch.begin(self, exchange)

    def _limit_read_ahead(self) -> None:
        """Pause reading once the pipelined requests waiting hold READ_AHEAD_REQUESTS or
        READ_AHEAD_BYTES. Constant time: it runs for every request a read brings, and one
        read can bring thousands (a scan of the pipeline each time stalled the loop for
        seconds, long enough for other connections' keep-alive timers to fire)."""
        queue = self._queue
        num_waiting = len(queue) - 1
        if num_waiting >= READ_AHEAD_REQUESTS:
            self.pause_reading()
        elif num_waiting > 0:
            size = sum(exchange.size_bytes for exchange in islice(queue, 1, None))
            if size >= READ_AHEAD_BYTES:
                self.pause_reading()

    def _is_answering(self) -> bool:
        """A request is received in full and not yet answered: the server's turn."""
        queue = self._queue
        return len(queue) > 1 or (bool(queue) and queue[0].is_received)

    def pause_reading(self) -> None:
        if not self.is_read_paused:
            self.is_read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.is_read_paused:
            self.is_read_paused = False
            if self._unread:  # the transport resumes after them, in their order
                self.loop.call_soon(self._read_unread)
            else:
                self._transport.resume_reading()

    def _read_unread(self) -> None:
        if self.is_read_paused or self.state is _CLOSED:
            return  # paused again first: they wait for the next resume
        data, self._unread = self._unread, b""
        self.data_received(data)
        if not self.is_read_paused:
            self._transport.resume_reading()

    # -- answers ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def send_continue(self) -> None:
        """Ask for the body (``100 Continue``): its --body-timeout-s counts from now, not
        from its head, which a pipelined request may have sent long before its turn (the
        client waits for this before it sends the body: the deadline had passed)."""
        self._transport.write(CONTINUE)
        if self.state is _BODY:
            self._body_deadline = self.loop.time() + self._app.limits.body_timeout_s
            self._arm_wait()

    def answer(self, exchange: Exchange, status: int, body: bytes, headers: Headers) -> None:
        """Status line, headers and body in one write; then close, or keep alive and
        begin the next request."""
        if self.running is exchange:
            self.running = None
        exchange.is_answered = True  # decided, if held: no other answer, nor its body read
        if self.state is _CLOSED:
            return  # a handler that ran on after its client left
        defaults = self._date.headers
        keep_alive = exchange.keep_alive
        if exchange.kind is _INFER or exchange.request is None:  # answers of few shapes
            head = self._answer_heads.head(defaults, status, headers, len(body), keep_alive)
        else:
            head = answer_head(defaults, status, headers, len(body), keep_alive)
            if exchange.method == "HEAD":
                body = b""
        data = head + body
        if self.is_write_paused:  # the client is not reading: hold it, read no more
            self._held = (exchange, data, status)
            return
        self._finish(exchange, data, status)

    def _finish(self, exchange: Exchange, data: bytes, status: int) -> None:
        exchange.release(self._app.inflight)
        self._transport.write(data)
        exchange.is_answered = True
        if self._server.access_log:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            access_log.info(
                '%s - "%s %s HTTP/%s" %d',
                client, exchange.method, exchange.path, exchange.http_version, status,
            )  # fmt: skip
        if not exchange.keep_alive:
            self._close_lingering()
        self._answered(exchange)

    async def stream(self, exchange: Exchange, stream: Stream) -> None:
        """A 200 whose body is sent in chunks as they come, each when the client reads.
        Once the connection is closing nothing more is written, and the chunks are drawn
        until the connection's loss cancels this (which closes them)."""
        head = answer_head(self._date.headers, 200, stream.headers, None, exchange.keep_alive)
        async with aclosing(stream.chunks) as chunks:
            if await self._writable():
                self._transport.write(head)
            async for data in chunks:
                if data and await self._writable():
                    self._transport.write(chunk(data))
        if await self._writable():
            self.running = None
            self._finish(exchange, LAST_CHUNK, 200)

    async def _writable(self) -> bool:
        """Wait while the client does not read; False once the connection is closing."""
        while self.is_write_paused and not self.is_closing():
            if self._drain is None:
                self._drain = self.loop.create_future()
            await self._drain
        return not self.is_closing()

    def _answered(self, exchange: Exchange) -> None:
        self._server.num_requests += 1
        if self.state >= _LINGERING or self._transport.is_closing():  # is_closing, inline
            return
        queue = self._queue
        if queue and queue[0] is exchange:
            queue.popleft()
        self._timer.deadline = None
        if self.room is not _WAITING:
            self.resume_reading()
        if not queue:
            self._arm_wait()
            return
        # Begun on the next loop turn: a run of pipelined requests answered on the spot
        # (400s) would otherwise begin each other recursively.
        self.loop.call_soon(self._begin, queue[0])
        if len(queue) > 1:
            self._limit_read_ahead()
        if self.state is _BODY:  # a body still arriving must go on arriving
            self._arm_wait()

    # -- waits ----------------------------------------------------------------------------

    def _arm_wait(self) -> None:
        """Start a wait of the server's keep-alive time, or to the body's deadline if that
        comes first."""
        deadline = self.loop.time() + self._keep_alive_s
        body_deadline = self._body_deadline
        if body_deadline is not None and body_deadline < deadline:
            deadline = body_deadline  # the whole body's time runs out first
        self._timer.arm(deadline)

    def _wait_expired(self) -> None:
        if self.is_closing() or self._is_answering() or self.is_read_paused:
            return  # the answer arms the wait again
        if self.state is _IDLE:
            self._transport.close()  # idle: closed without a word
            return
        if self.state >= _REFUSED:
            return
        body_deadline = self._body_deadline
        if (
            self.state is _BODY
            and body_deadline is not None
            and self.loop.time() + 0.001 >= body_deadline
        ):
            timeout_s = self._app.limits.body_timeout_s
            self._refuse(
                408,
                f"the request body did not arrive in full within {timeout_s} s of its head "
                "(carpool serve --body-timeout-s)",
            )
            return
        what = "body" if self.state is _BODY else "head"
        timeout_s = self._keep_alive_s
        self._refuse(408, f"the request {what} did not arrive in full within {timeout_s:g} s")

    # -- refusals and closing -------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        """An error answer about the connection's bytes, then close it. Requests received
        before the bad bytes are answered first, in order; the refusal waits for its turn.
        The request whose body the bad bytes cut short gets the refusal as its answer."""
        if self.state >= _REFUSED or self.is_closing():
            return
        was_receiving_body = self.state is _BODY
        self.state = _REFUSED
        answer = refusal_answer(status, message, self._date.headers)
        queue = self._queue
        incoming = self._incoming
        if was_receiving_body and incoming is not None:  # the bad bytes are in its body
            if queue and queue[-1] is incoming and not incoming.is_started:
                incoming.release(self._app.inflight)  # not begun: the refusal takes its turn
                queue[-1] = self._refusal(answer)
                return
        elif queue:  # requests before the bad bytes
            queue.append(self._refusal(answer))
            return
        self.write_refusal(answer)

    def _refusal(self, answer: bytes) -> Exchange:
        refusal = Exchange(_REFUSAL, "-", "-", "1.1", False, self._read_s)
        refusal.refusal, refusal.is_received = answer, True
        return refusal

    def write_refusal(self, answer: bytes) -> None:
        if not self.is_closing():
            self._transport.write(answer)
            self._transport.close()  # at once: bytes that broke the protocol, not a body

    def is_closing(self) -> bool:
        return self.state >= _LINGERING or self._transport.is_closing()

    def _close_lingering(self) -> None:
        """Close the connection after what was written; half-closed for LINGER_S when
        the client may still be sending the request being received."""
        transport = self._transport
        if self.is_closing():
            return
        if not _HEAD <= self.state <= _REFUSED or not can_write_eof(transport):
            transport.close()
            return
        # From here on the connection is closing: the rest of the read being parsed,
        # requests pipelined behind, the wait are all left alone.
        self.state = _LINGERING
        self._timer.deadline = None
        inflight = self._app.inflight
        for waiting in self._queue:
            waiting.release(inflight)
        self._queue.clear()
        transport.write_eof()  # after what is buffered
        self.resume_reading()  # a paused transport would never see the client close
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def abort(self) -> None:
        """Close now, whatever is unanswered (a stop's grace is over)."""
        self._transport.close()

    def shutdown(self) -> None:
        """The server stops: close now when idle, else after the newest request's
        answer."""
        if self.is_closing():
            return
        if self._queue:
            self._queue[-1].keep_alive = False
        else:
            self._transport.close()
