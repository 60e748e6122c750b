"""The one body check (carpool.server.http.body), as the protocol and the ASGI app both
use it: ``--max-request-bytes`` first, then the bytes held across connections."""

from __future__ import annotations

from carpool.server.errors import PayloadTooLarge
from carpool.server.http.body import BodyBytes, BodyCheck, declared_too_large
from carpool.server.limits import InflightBytes


def test_a_declared_length_over_the_limit_is_a_413_before_the_body() -> None:
    assert declared_too_large(b"100", 100) is None
    too_large = declared_too_large(b"101", 100)
    assert isinstance(too_large, PayloadTooLarge) and too_large.is_unread
    assert "101 bytes exceeds the limit of 100" in str(too_large)


def test_a_body_past_the_limit_is_too_large_before_it_is_held() -> None:
    inflight = InflightBytes(1000)
    body = BodyBytes()
    assert body.add(b"a" * 60, 100, inflight) is BodyCheck.TAKEN
    assert body.add(b"b" * 50, 100, inflight) is BodyCheck.TOO_LARGE
    assert (body.held_bytes, inflight.held_bytes) == (60, 60)
    assert "110 bytes" in str(body.too_large(100))


def test_a_body_past_the_budget_holds_nothing_more_and_gives_back_what_it_held() -> None:
    inflight = InflightBytes(100)
    other = BodyBytes()
    assert other.hold(80, inflight)
    body = BodyBytes()
    assert body.add(b"a" * 10, 1000, inflight) is BodyCheck.TAKEN
    assert body.add(b"b" * 20, 1000, inflight) is BodyCheck.OVER_BUDGET
    body.release(inflight)
    other.release(inflight)
    assert inflight.held_bytes == 0 and inflight.num_refused == 1


def test_a_body_held_from_its_declared_length_takes_no_more_for_its_chunks() -> None:
    inflight = InflightBytes(100)
    body = BodyBytes()
    assert body.hold(30, inflight)
    for piece in (b"a" * 10, b"b" * 20):
        assert body.add(piece, 1000, inflight) is BodyCheck.TAKEN
    assert inflight.held_bytes == 30
    assert body.take() == b"a" * 10 + b"b" * 20 and body.chunks == []
