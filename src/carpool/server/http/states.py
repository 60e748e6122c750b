"""What dispatch sees of a connection: its states, its place in the waiting room, and
the calls it makes on it (:class:`ConnectionPort`, which
:class:`~carpool.server.http.connection.Connection` is). Dispatch and the connection
each import this module, not each other."""

from __future__ import annotations

import asyncio
import enum
from typing import Protocol

from carpool.server.http.exchange import Exchange
from carpool.server.http.handlers import Stream
from carpool.server.infer import Headers


class ConnectionState(enum.IntEnum):
    """Where a connection is; ordered: from REFUSED on, nothing more is read."""

    IDLE = 0  # between requests: the wait for the next head
    HEAD = 1  # a request's head is arriving
    BODY = 2  # its head is complete, its body arriving
    REFUSED = 3  # bad bytes came: answered in their turn, then closed
    LINGERING = 4  # half-closed after a closing answer while the client sends
    CLOSED = 5  # the transport is lost


class Room(enum.Enum):
    """A connection and the waiting room (:mod:`carpool.server.waiting`)."""

    OUT = "out"
    WAITING = "waiting"  # refused (429): not read until its model has room
    HAS_PLACE = "has place"  # let out: its next request has a place kept


class ConnectionPort(Protocol):
    """The connection as dispatch drives it."""

    loop: asyncio.AbstractEventLoop
    room: Room
    running: Exchange | None
    state: ConnectionState
    tasks: set[asyncio.Task[None]]

    def answer(self, exchange: Exchange, status: int, body: bytes, headers: Headers) -> None: ...

    def is_closing(self) -> bool: ...

    @property
    def num_ahead(self) -> int:
        """Requests of this connection read before the one whose head is being read, and
        not answered yet (pipelined)."""
        ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    async def stream(self, exchange: Exchange, stream: Stream) -> None: ...

    def write(self, data: bytes) -> None: ...

    def send_continue(self) -> None: ...

    def write_refusal(self, answer: bytes) -> None: ...
