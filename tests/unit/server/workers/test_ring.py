"""The shared-memory byte ring between a front-end worker and the engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from carpool.server.workers.ring import LENGTH_BYTES, Ring


@pytest.fixture
def ends() -> Iterator[tuple[Ring, Ring]]:
    writer = Ring(None, 64, create=True)
    reader = Ring(writer.name, 64, create=False)
    yield writer, reader
    reader.close()
    writer.close()


def test_records_come_out_as_written(ends: tuple[Ring, Ring]) -> None:
    writer, reader = ends
    assert writer.write([b"ab", b"cd"])
    assert writer.write([b""])
    assert reader.read_to(writer.write_pos) == [b"abcd", b""]


def test_many_records_per_notification_and_only_up_to_the_position_sent(
    ends: tuple[Ring, Ring],
) -> None:
    writer, reader = ends
    assert writer.write([b"1"])
    sent = writer.write_pos
    assert writer.write([b"2"])
    assert writer.write([b"3"])
    assert reader.read_to(sent) == [b"1"]
    assert reader.read_to(writer.write_pos) == [b"2", b"3"]


def test_wraps_around_the_end_without_splitting_a_record(ends: tuple[Ring, Ring]) -> None:
    writer, reader = ends
    seen = []
    for i in range(50):  # 50 x 14 bytes through a ring of 64: wraps many times
        record = bytes([i]) * 10
        assert writer.write([record])
        seen += reader.read_to(writer.write_pos)
    assert seen == [bytes([i]) * 10 for i in range(50)]


def test_a_full_ring_refuses_until_the_reader_frees_space(ends: tuple[Ring, Ring]) -> None:
    writer, reader = ends
    record = b"x" * (32 - LENGTH_BYTES)
    assert writer.write([record])
    assert writer.write([record])
    assert not writer.write([b"y"])  # full: nothing written
    assert reader.read_to(writer.write_pos) == [record, record]
    assert writer.write([b"y"])
    assert reader.read_to(writer.write_pos) == [b"y"]


def test_a_record_larger_than_the_ring_is_refused(ends: tuple[Ring, Ring]) -> None:
    writer, reader = ends
    assert not writer.write([b"z" * 61])
    assert writer.write_pos == 0
    assert writer.write([b"z" * 60])  # exactly the ring, length included
    assert reader.read_to(writer.write_pos) == [b"z" * 60]


def test_records_are_writable_copies(ends: tuple[Ring, Ring]) -> None:
    writer, reader = ends
    writer.write([b"abc"])
    (record,) = reader.read_to(writer.write_pos)
    record[0] = ord("X")  # a copy: the ring's bytes may be reused at once
    assert isinstance(record, bytearray)
