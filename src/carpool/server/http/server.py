"""The listening side of carpool's HTTP/1.1 server, and what its connections share.

Accepting: the server owns its listening sockets. Each time one is readable it accepts
up to :data:`MAX_ACCEPTS_PER_TURN` connections (a loop turn of a loaded server lasts a
batch of the model, tens of milliseconds on one core: accepting one a turn, as libuv
does, left 1,000 clients connecting at once in the listen queue for up to a minute, and a
health probe behind them timed out), and reads each one's first bytes at once: a probe on
a new connection is answered as soon as its transport exists, without waiting turns for
the socket to be reported readable. Out of file descriptors, a waiting connection is
accepted on a spare one and closed at once (libuv's way): the listener does not spin,
and the clients are told rather than left waiting.

Stopping (:meth:`HttpServer.shutdown`): no more connections are accepted; an idle
connection closes at once, a busy one after the answer to its newest request; once all
have closed, or ``grace_s`` has passed (then what is left is cut: tasks cancelled,
connections closed), it returns.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Callable

from carpool.server.app import KServeApp
from carpool.server.http.answer import AnswerHeads, DateHeader
from carpool.server.http.connection import Connection
from carpool.server.http.dispatch import Dispatch
from carpool.server.http.guards import DEFAULT_KEEP_ALIVE_S

log = logging.getLogger("carpool.server.http")

MAX_ACCEPTS_PER_TURN = 128
BACKLOG = 2048  # the listen queue, as uvicorn's
FIRST_READ_BYTES = 64 * 1024  # a request head, or a small request whole
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class HttpServer:
    """carpool's HTTP/1.1 server for ``app``: its connections, what they share, and the
    sockets it listens on once :meth:`start` is called.

    ``timeout_keep_alive_s``: how long a connection may wait for its next request's head
    (and a body stall between two reads); ``access_log``: one INFO line per answer on
    the ``carpool.server.access`` logger; ``monotonic``: the clock a read's time is taken
    on, from which its requests' deadlines count: the batchers' (a test gives its
    FakeClock's ``now``).
    """

    def __init__(
        self,
        app: KServeApp,
        *,
        timeout_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        access_log: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.dispatch = Dispatch(app)
        self.timeout_keep_alive_s = timeout_keep_alive_s
        self.access_log = access_log
        self.monotonic = monotonic
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # route handlers running
        self.num_requests = 0  # answered, over the server's life
        self.num_accepted = 0
        self.answer_heads = AnswerHeads()
        self.date = DateHeader()
        self.addresses: list[tuple[str, int]] = []  # where it listens (port 0: the one given)
        self._listeners: list[socket.socket] = []
        self._connecting: set[asyncio.Task[None]] = set()
        self._date_timer: asyncio.TimerHandle | None = None
        self._spare_fd: int | None = None

    def connection(self, first_read: bytes = b"") -> Connection:
        """A new connection's protocol; ``first_read``: its first bytes, already read."""
        return Connection(self, first_read)

    # -- listening ------------------------------------------------------------------------

    def start(self, sockets: list[socket.socket]) -> None:
        """Listen on ``sockets`` (bound, not yet listening) and accept connections."""
        loop = asyncio.get_running_loop()
        self._spare_fd = _spare()
        for sock in sockets:
            sock.setblocking(False)
            sock.listen(BACKLOG)
            self._listeners.append(sock)
            self.addresses.append(sock.getsockname()[:2])
            loop.add_reader(sock.fileno(), self._accept, sock)
        self._tick()

    def close(self) -> None:
        """Accept no more connections: the listening sockets are closed."""
        loop = asyncio.get_running_loop()
        for sock in self._listeners:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners = []
        if self._date_timer is not None:
            self._date_timer.cancel()
            self._date_timer = None
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    def _tick(self) -> None:
        """The date of the answers, new each second."""
        self.date.tick()
        delay_s = 1.0 - time.time() % 1.0 + 0.001
        self._date_timer = asyncio.get_running_loop().call_later(delay_s, self._tick)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(MAX_ACCEPTS_PER_TURN):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return  # none left
            except ConnectionAbortedError:
                continue  # it left while waiting
            except OSError as error:
                if error.errno in _OUT_OF_DESCRIPTORS:
                    self._turn_away(listener)
                else:
                    log.warning("accepting a connection failed: %s", error)
                return
            self.num_accepted += 1
            self._serve(sock)

    def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            first_read = sock.recv(FIRST_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            first_read = b""  # nothing sent yet: the transport reads it when it comes
        except OSError:  # reset before it was served
            sock.close()
            return
        else:
            if not first_read:  # closed before it sent anything
                sock.close()
                return
        connecting = asyncio.ensure_future(self._connect(sock, self.connection(first_read)))
        self._connecting.add(connecting)
        connecting.add_done_callback(self._connecting.discard)

    async def _connect(self, sock: socket.socket, protocol: Connection) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, sock)
        except OSError:  # the client left before it was served
            sock.close()

    def _turn_away(self, listener: socket.socket) -> None:
        """Out of file descriptors: accept the waiting connections on the spare one and
        close them at once, rather than leave the listener readable (the loop would spin
        on it) and the clients waiting."""
        if self._spare_fd is None:
            return
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            for _ in range(MAX_ACCEPTS_PER_TURN):
                sock, _ = listener.accept()
                sock.close()
        except OSError:
            pass
        self._spare_fd = _spare()

    # -- stopping -------------------------------------------------------------------------

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let every connection close once its accepted requests are
        answered, for at most ``grace_s``; then cancel and close what is left."""
        self.close()
        for connection in list(self.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(grace_s):
                while self.connections or self.tasks:  # noqa: ASYNC110 - a few polls a stop
                    await asyncio.sleep(0.05)
        except TimeoutError:
            log.error(
                "stopping: %d connection(s) and %d task(s) still open %g s after the stop; closed",
                len(self.connections),
                len(self.tasks),
                grace_s,
            )
            self.cut()

    def cut(self) -> None:
        """Cancel the handlers still running and close every connection now."""
        for task in list(self.tasks):
            task.cancel()
        for connection in list(self.connections):
            connection.abort()


def _spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None
