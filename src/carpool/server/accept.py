"""Accepting connections in bursts, beside the event loop's own accept.

libuv (under uvloop) accepts one connection per turn of the event loop. A turn of a
loaded server lasts a batch of the model (tens of milliseconds on one core), so 1,000
clients connecting at once waited in the listen queue for up to a minute, and a health
probe on a new connection (as a kubelet or a load balancer sends) behind them timed
out (strace: one ``accept4`` every 13 to 50 ms under overload). An :class:`Acceptor`
watches a duplicate of each listening socket and, each time it is readable, accepts
up to :data:`MAX_ACCEPTS_PER_TURN` connections and hands each to the loop as an accepted
socket, served by the same protocol. The loop's own accept goes on; the two take turns
on one listen queue, and one of them finds it empty (EAGAIN), which costs nothing.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("carpool.server")

MAX_ACCEPTS_PER_TURN = 128
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class Acceptor:
    """Accepts on duplicates of ``sockets`` for ``protocol_factory`` until :meth:`stop`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        protocol_factory: Callable[[], asyncio.Protocol],
    ) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._listeners: list[socket.socket] = []
        self.num_accepted = 0
        for sock in sockets:
            listener = socket.socket(fileno=socket.dup(sock.fileno()))
            listener.setblocking(False)
            self._listeners.append(listener)
            loop.add_reader(listener.fileno(), self._accept, listener)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(MAX_ACCEPTS_PER_TURN):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left (or the loop's own accept took it)
            except OSError as error:
                if error.errno in _OUT_OF_DESCRIPTORS:
                    return  # the loop's own accept handles running out of descriptors
                raise
            self.num_accepted += 1
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._loop.create_task(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:  # the client left before it was served
            conn.close()

    def stop(self) -> None:
        """Accept no more: the listening duplicates are closed."""
        for listener in self._listeners:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners = []
