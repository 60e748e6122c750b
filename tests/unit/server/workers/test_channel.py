"""Records between two ends of a channel: through the ring, or inline on the socket when
the ring has no room, always in the order they were sent."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from carpool.server.workers.channel import Channel, Grouper
from carpool.server.workers.records import Kind, decode, encode, group_key, split_group
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


def _result(request_id: object, arrays: dict[str, np.ndarray]) -> list[bytes | memoryview]:
    return encode(Kind.RESULT, {"id": request_id}, arrays)


def _add(grouper: Grouper, item: object, arrays: dict[str, np.ndarray]) -> None:
    key = group_key(arrays)
    assert key is not None, "the tests add arrays that can be joined"
    grouper.add(key, item, arrays)


async def test_a_loop_turns_requests_go_as_one_group_record_per_shape(
    pair: tuple[End, End],
) -> None:
    a, b = pair
    grouper = Grouper(Kind.RESULTS, lambda: a.channel, _result)
    rows = [np.full((1, 3), i, np.float32) for i in range(4)]
    for i, row in enumerate(rows):
        _add(grouper, i, {"O": row})
    others = [{"O": np.arange(2, dtype=np.int64).reshape(2, 1) + i} for i in range(2)]
    for i, other in enumerate(others):  # another dtype and shape: a group of its own
        _add(grouper, 8 + i, other)
    assert b.received == [] and grouper.has_pending  # sent at the end of the turn
    await _until(lambda: len(b.received) == 2, "two group records")
    assert (grouper.num_sent, a.channel.num_notified) == (2, 1)
    first, second = (split_group(decode(bytearray(r))) for r in b.received)
    assert [item for item, _ in first] == [0, 1, 2, 3]
    for (_, arrays), row in zip(first, rows, strict=True):
        np.testing.assert_array_equal(arrays["O"], row)
    assert [(item, arrays["O"].tolist()) for item, arrays in second] == [
        (8, [[0], [1]]),
        (9, [[1], [2]]),
    ]


async def test_a_request_alone_in_its_turn_goes_as_a_record_of_its_own(
    pair: tuple[End, End],
) -> None:
    a, b = pair
    grouper = Grouper(Kind.RESULTS, lambda: a.channel, _result)
    arrays = {"O": np.ones((1, 2), np.float32)}
    _add(grouper, 5, arrays)
    await _until(lambda: len(b.received) == 1, "the record")
    record = decode(bytearray(b.received[0]))
    assert (record.kind, record.header["id"], grouper.num_sent) == (Kind.RESULT, 5, 0)
    assert record.arrays["O"].tolist() == [[1.0, 1.0]]


async def test_a_group_flushed_early_keeps_its_place_and_is_not_sent_twice(
    pair: tuple[End, End],
) -> None:
    a, b = pair
    grouper = Grouper(Kind.INFERS, lambda: a.channel, _result)
    arrays = {"X": np.ones((1, 2), np.float32)}
    for request_id in (1, 2):
        _add(grouper, {"id": request_id}, arrays)
    grouper.flush()  # a record that must follow it is about to be sent
    a.channel.send([b"after"])
    await _until(lambda: len(b.received) == 2, "the group, then the record")
    assert b.received[1] == b"after"
    assert decode(bytearray(b.received[0])).header["items"] == [{"id": 1}, {"id": 2}]
    await asyncio.sleep(0)
    assert grouper.num_sent == 1 and len(b.received) == 2


async def test_a_group_for_a_channel_gone_is_dropped() -> None:
    grouper = Grouper(Kind.RESULTS, lambda: None, _result)
    arrays = {"O": np.zeros((1, 1), np.float32)}
    _add(grouper, 1, arrays)
    await asyncio.sleep(0)
    assert grouper.num_sent == 0 and not grouper.has_pending
