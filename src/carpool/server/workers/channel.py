"""One end of the channel between a front-end worker and the engine: two shared-memory
rings (:mod:`carpool.server.workers.ring`), one each way, and a socket that carries the
notifications.

::

    worker                                   engine
    ring "to engine"  --- records --------->  (read up to the position sent)
    socket            --- b"P" + position -->  one per loop turn, however many records
    ring "to worker"  <-- records ----------
    socket            <-- b"P" + position ---

A record that does not fit in its ring now (the ring is full, or the record is larger than
the whole ring) travels inline on the socket instead, as ``b"I" + length + record``,
after the position of the records written before it, so records arrive in the order
they were sent whichever way each went. Nothing waits for space and nothing is lost.

The socket closing (the other process exited or died) calls ``on_lost``.

Requests' arrays one side writes in one loop turn (the results of a batch for one worker,
the requests a worker read in one turn) go as one group record per shape at the turn's
end (:class:`Grouper`), with one notification for them all.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from carpool.server.workers.records import GroupKey, Kind, encode_group
from carpool.server.workers.ring import Ring

_POSITION = b"P"
_INLINE = b"I"
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_MESSAGE_HEAD_BYTES = 1 + _U64.size  # the larger of the two heads


class Channel(asyncio.Protocol):
    """Sends records on ``outgoing`` and hands each record read from ``incoming`` to
    ``on_record``, in order."""

    def __init__(
        self,
        outgoing: Ring,
        incoming: Ring,
        on_record: Callable[[bytearray], None],
        on_lost: Callable[[], None],
    ) -> None:
        self._out = outgoing
        self._in = incoming
        self._on_record = on_record
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._sent_pos = 0
        self._is_flush_due = False
        self.num_inline = 0  # records that went on the socket: the ring had no room
        self.num_notified = 0  # positions sent
        self.is_open = False

    # -- asyncio's side -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        self.is_open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_open = False
        self._transport = None
        self._on_lost()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at, end_pos = 0, -1
        while len(buffer) - at >= _MESSAGE_HEAD_BYTES or (
            len(buffer) - at >= 1 + _U32.size and buffer[at : at + 1] == _INLINE
        ):
            tag = buffer[at : at + 1]
            if tag == _POSITION:
                end_pos = _U64.unpack_from(buffer, at + 1)[0]
                at += _MESSAGE_HEAD_BYTES
                continue
            size = _U32.unpack_from(buffer, at + 1)[0]
            start = at + 1 + _U32.size
            if len(buffer) < start + size:
                break
            if end_pos >= 0:  # the ring's records sent before this one come first
                self._read_ring(end_pos)
                end_pos = -1
            at = start + size
            self.num_inline += 1
            self._on_record(buffer[start:at])
        if end_pos >= 0:
            self._read_ring(end_pos)
        del buffer[:at]

    def _read_ring(self, end_pos: int) -> None:
        for record in self._in.read_to(end_pos):
            self._on_record(record)

    # -- sending ----------------------------------------------------------------------------

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Send one record (its parts, in order); dropped when the channel is closed."""
        transport = self._transport
        if transport is None:
            return
        size = sum(map(len, parts))
        if self._out.write(parts, size):
            if not self._is_flush_due:
                self._is_flush_due = True
                asyncio.get_running_loop().call_soon(self.flush)
            return
        self.flush()  # the records before it first
        transport.write(b"".join([_INLINE, _U32.pack(size), *parts]))

    def flush(self) -> None:
        """Tell the other end how far the ring is written (one message for every record
        written since the last one)."""
        self._is_flush_due = False
        pos = self._out.write_pos
        if pos != self._sent_pos and self._transport is not None:
            self._sent_pos = pos
            self.num_notified += 1
            self._transport.write(_POSITION + _U64.pack(pos))

    def close(self) -> None:
        if self._transport is not None:
            self.flush()
            self._transport.close()


# A request alone in its group goes as a record of its own (``one`` makes it): a group of
# one costs more to encode and split than the plain record (benchmarks/bench_handoff.py).
OneRecord = Callable[[Any, dict[str, np.ndarray]], list[bytes | memoryview]]


class Grouper:
    """Collects the requests added in one loop turn, and at its end sends them as one
    ``kind`` group record per :func:`~carpool.server.workers.records.group_key` on
    ``channel()`` (the channel of the moment, None once it is gone), notified at once;
    a request alone in its group as ``one(item, arrays)``."""

    def __init__(self, kind: Kind, channel: Callable[[], Channel | None], one: OneRecord) -> None:
        self._kind = kind
        self._channel = channel
        self._one = one
        self._groups: dict[GroupKey, tuple[list[Any], list[dict[str, np.ndarray]]]] = {}
        self.num_sent = 0  # group records sent (not counting records of one)

    @property
    def has_pending(self) -> bool:
        return bool(self._groups)

    def add(self, key: GroupKey, item: Any, arrays: dict[str, np.ndarray]) -> None:
        """Send ``item`` (a request's fields) and its ``arrays`` (of ``key``) at the end
        of this loop turn."""
        groups = self._groups
        if not groups:
            asyncio.get_running_loop().call_soon(self.flush)
        group = groups.get(key)
        if group is None:
            groups[key] = ([item], [arrays])
        else:
            group[0].append(item)
            group[1].append(arrays)

    def flush(self) -> None:
        """Send what was added (before a record that must come after it, or at the
        turn's end); dropped when the channel is gone."""
        groups, self._groups = self._groups, {}
        channel = self._channel()
        if not groups or channel is None:
            return
        for items, arrays in groups.values():
            if len(items) == 1:
                channel.send(self._one(items[0], arrays[0]))
            else:
                channel.send(encode_group(self._kind, items, arrays))
                self.num_sent += 1
        channel.flush()
