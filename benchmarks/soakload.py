"""soak.py's load generator: raw HTTP/1.1 keep-alive connections on one asyncio loop
(uvloop when installed), one pre-encoded request written as it is, answers parsed by
httptools (llhttp, in C). No task, future or header dict per request: a connection's
protocol calls back the load when its answer is complete, and the load writes the next
request from there. That is what lets one Python process offer tens of thousands of
requests a second; when it cannot, the run's CPU ratio and offered rate say so.

* ``closed_loop``: ``connections`` connections, each writing its next request the moment
  it has an answer, refusals included (instant retry); a connection that is lost or
  closed is opened again; a connect that is refused is counted and tried again 10 ms later.
* ``open_loop``: Poisson arrivals at ``rate_rps`` (a fixed seed) sent on idle connections
  of a pool opened on demand up to ``max_connections``; an arrival with no free
  connection waits in the client, and that wait counts in ``answered_waited_s``.

Both stop writing after ``duration_s``, wait up to ``drain_s`` for the answers still due,
and count the rest as unanswered (see :mod:`soakstats`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import cast

import httptools
import numpy as np

from carpool.tools.loadgen import Arrival, ArrivalProcess
from soakstats import Tally

RECONNECT_DELAY_S = 0.01
TICK_S = 0.001  # open loop: arrivals due are released together, each keeps its own time
_now = time.perf_counter


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    __slots__ = ("busy", "load", "parser", "scheduled_s", "sent_s", "transport")

    def __init__(self, load: _Load) -> None:
        self.load = load
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.sent_s = 0.0
        self.scheduled_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # not HTTP: counts as lost when it closes
            self.close()

    def on_message_complete(self) -> None:
        if not self.busy:  # an answer nobody asked for: not HTTP as we speak it
            self.close()
            return
        self.busy = False
        status = self.parser.get_status_code()
        self.load.answered(self, status, self.parser.should_keep_alive())

    def connection_lost(self, exc: Exception | None) -> None:
        was_busy, self.busy = self.busy, False
        self.transport = None
        self.load.closed(self, was_busy)

    def send(self, request: bytes, scheduled_s: float) -> None:
        assert self.transport is not None
        self.busy = True
        self.scheduled_s = scheduled_s
        self.sent_s = _now()
        self.transport.write(request)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Load:
    """What both loops share: the target, the request, the tally and the connections."""

    def __init__(self, host: str, port: int, request: bytes, tally: Tally) -> None:
        self.host = host
        self.port = port
        self.request = request
        self.tally = tally
        self.is_sending = True
        self.connections: set[_Connection] = set()
        self.num_opening = 0
        self.num_in_flight = 0
        self._drained = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, connection: _Connection, scheduled_s: float) -> None:
        self.tally.num_sent += 1
        self.num_in_flight += 1
        connection.send(self.request, scheduled_s)

    def _one_done(self) -> None:
        self.num_in_flight -= 1
        if not self.num_in_flight and not self.is_sending:
            self._drained.set()

    def answered(self, connection: _Connection, status: int, keep_alive: bool) -> None:
        now = _now()
        self.tally.answer(status, connection.sent_s, now, connection.scheduled_s)
        self._one_done()
        if not keep_alive:
            connection.close()  # closed() follows
            return
        self.ready(connection)

    def closed(self, connection: _Connection, was_busy: bool) -> None:
        if connection not in self.connections:
            return  # closed before _open took it: _open tries again
        self.connections.discard(connection)
        if was_busy:
            self.tally.num_lost += 1
            self._one_done()
        self.replace(connection)

    def ready(self, connection: _Connection) -> None:
        raise NotImplementedError

    def replace(self, connection: _Connection) -> None:
        raise NotImplementedError

    def open(self) -> None:
        """Open one more connection in the background; ready() is called when it is."""
        self.num_opening += 1
        task = asyncio.get_running_loop().create_task(self._open())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        while self.is_sending:
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
            except OSError:  # refused, reset during the handshake, out of ports
                self.tally.num_not_accepted += 1
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            if connection.transport is None:  # closed by the server before a byte was sent
                self.tally.num_not_accepted += 1
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            self.num_opening -= 1
            self.connections.add(connection)
            self.ready(connection)
            return
        self.num_opening -= 1

    async def finish(self, drain_s: float) -> None:
        """Stop writing, wait up to ``drain_s`` for the answers still due, count the
        rest as unanswered and close every connection."""
        self.is_sending = False
        if not self.num_in_flight:
            self._drained.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), drain_s)
        self.tally.num_unanswered = self.num_in_flight
        for connection in list(self.connections):
            connection.busy = False  # given up on: not lost twice
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.sleep(0.05)  # let the transports run their close callbacks


class _ClosedLoop(_Load):
    def ready(self, connection: _Connection) -> None:
        if self.is_sending:
            self.send(connection, _now())

    def replace(self, connection: _Connection) -> None:
        if self.is_sending:
            self.open()


class _OpenLoop(_Load):
    def __init__(
        self, host: str, port: int, request: bytes, tally: Tally, max_connections: int
    ) -> None:
        super().__init__(host, port, request, tally)
        self.max_connections = max_connections
        self.idle: list[_Connection] = []
        self.backlog: collections.deque[float] = collections.deque()

    def ready(self, connection: _Connection) -> None:
        if self.backlog and self.is_sending:
            self.send(connection, self.backlog.popleft())
        else:
            self.idle.append(connection)

    def replace(self, connection: _Connection) -> None:
        if connection in self.idle:
            self.idle.remove(connection)
        self.dispatch()

    def dispatch(self) -> None:
        """Send what is due on idle connections; open more (up to the pool's size) for
        what is left."""
        while self.backlog and self.idle:
            self.ready(self.idle.pop())
        room = self.max_connections - len(self.connections) - self.num_opening
        for _ in range(min(room, len(self.backlog) - self.num_opening)):
            self.open()


async def closed_loop(
    host: str, port: int, request: bytes, connections: int, duration_s: float, drain_s: float
) -> Tally:
    """``connections`` connections sending back to back for ``duration_s``."""
    tally = Tally(start_s=_now(), duration_s=duration_s)
    load = _ClosedLoop(host, port, request, tally)
    cpu_start = time.process_time()
    for _ in range(connections):
        load.open()
    await asyncio.sleep(max(0.0, tally.start_s + duration_s - _now()))
    tally.client_cpu_s = time.process_time() - cpu_start
    await load.finish(drain_s)
    return tally


async def open_loop(
    host: str,
    port: int,
    request: bytes,
    rate_rps: float,
    duration_s: float,
    drain_s: float,
    *,
    max_connections: int,
    seed: int,
) -> Tally:
    """Poisson arrivals at ``rate_rps`` for ``duration_s`` on at most ``max_connections``."""
    offsets = ArrivalProcess.steady(rate_rps, Arrival.POISSON).send_times(
        duration_s, np.random.default_rng(seed)
    )
    loop = asyncio.get_running_loop()
    tally = Tally(start_s=_now(), duration_s=duration_s)
    load = _OpenLoop(host, port, request, tally, max_connections)
    times = (offsets + tally.start_s).tolist()
    cpu_start = time.process_time()
    done = asyncio.Event()
    next_index = 0

    def tick() -> None:
        nonlocal next_index
        now = _now()
        while next_index < len(times) and times[next_index] <= now:
            load.backlog.append(times[next_index])
            next_index += 1
        load.dispatch()
        if next_index < len(times):  # at most one tick a millisecond: never a busy loop
            loop.call_later(max(TICK_S, times[next_index] - _now()), tick)
        else:
            done.set()

    tick()
    await done.wait()
    await asyncio.sleep(max(0.0, tally.start_s + duration_s - _now()))
    tally.client_cpu_s = time.process_time() - cpu_start
    tally.num_unsent = len(load.backlog)
    load.backlog.clear()
    await load.finish(drain_s)
    return tally


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
