"""Records between two ends of a channel: through the ring, or inline on the socket when
the ring has no room, always in the order they were sent."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from carpool.server.workers.channel import Channel
from carpool.server.workers.ring import Ring

RING_BYTES = 256


@dataclass
class End:
    channel: Channel
    received: list[bytes] = field(default_factory=list)
    lost: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[End, End]]:
    loop = asyncio.get_running_loop()
    a_to_b = Ring(None, RING_BYTES, create=True)
    b_to_a = Ring(None, RING_BYTES, create=True)
    rings = [a_to_b, b_to_a, Ring(a_to_b.name, RING_BYTES, create=False)]
    rings.append(Ring(b_to_a.name, RING_BYTES, create=False))
    ends = []
    for outgoing, incoming, sock in zip(rings[:2], rings[:1:-1], socket.socketpair(), strict=True):
        received: list[bytes] = []
        lost = asyncio.Event()
        channel = Channel(
            outgoing, incoming, lambda r, into=received: into.append(bytes(r)), lost.set
        )
        sock.setblocking(False)
        await loop.create_unix_connection(lambda c=channel: c, sock=sock)
        ends.append(End(channel, received, lost))
    yield ends[0], ends[1]
    for end in ends:
        end.channel.close()
    await asyncio.sleep(0)
    for ring in rings:
        ring.close()


async def _until(condition: object, what: str) -> None:
    for _ in range(1000):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


async def test_records_written_in_one_loop_turn_take_one_notification(
    pair: tuple[End, End],
) -> None:
    a, b = pair
    for i in range(5):
        a.channel.send([b"r", bytes([i])])
    await _until(lambda: len(b.received) == 5, "five records")
    assert b.received == [b"r" + bytes([i]) for i in range(5)]
    assert a.channel.num_notified == 1
    assert b.channel.num_inline == 0


async def test_a_record_larger_than_the_ring_goes_inline_in_order(pair: tuple[End, End]) -> None:
    a, b = pair
    big = b"B" * (RING_BYTES * 4)
    a.channel.send([b"first"])
    a.channel.send([big])
    a.channel.send([b"last"])
    await _until(lambda: len(b.received) == 3, "three records")
    assert b.received == [b"first", big, b"last"]
    assert b.channel.num_inline == 1


async def test_a_full_ring_sends_inline_instead_of_waiting(pair: tuple[End, End]) -> None:
    a, b = pair
    records = [bytes([i]) * 100 for i in range(10)]  # 1 KB through a ring of 256 bytes
    for record in records:
        a.channel.send([record])
    await _until(lambda: len(b.received) == 10, "ten records")
    assert b.received == records
    assert b.channel.num_inline > 0


async def test_both_directions_at_once(pair: tuple[End, End]) -> None:
    a, b = pair
    a.channel.send([b"ping"])
    b.channel.send([b"pong"])
    await _until(lambda: a.received and b.received, "a record each way")
    assert (a.received, b.received) == ([b"pong"], [b"ping"])


async def test_the_other_end_closing_is_reported(pair: tuple[End, End]) -> None:
    a, b = pair
    a.channel.close()
    await asyncio.wait_for(b.lost.wait(), 10)
    assert not b.channel.is_open
