"""What guards a connection (carpool.server.http.guards): the head's limits, how far
pipelined requests are read ahead, and the waits one lazily armed timer times.

The keep-alive wait is timed lazily: one loop timer per connection, not one per answer.
Was: uvicorn armed a timer (``loop.call_later``) for every answer and cancelled it when
the next request began. Now an answer only moves the wait's deadline; the one timer,
when it fires, sleeps on to the deadline of the wait then running. What the timer
decides is unchanged: an idle connection still closes timeout_keep_alive_s after its
last answer, never under a request being answered. Where a test drives the timer, it
calls the handler the timer would call, or moves the fake clock of the connection's loop
(FakeLoop); it never waits for it. The tests whose docstrings start "Was:" failed before
the fixes they name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from carpool.server.http.connection import Connection
from carpool.server.http.guards import (
    MAX_HEAD_BYTES,
    MAX_HEADER_FIELDS,
    READ_AHEAD_REQUESTS,
    head_refusal,
)

from .fakes import BAD, FakeLoop, Setup, Transport, binary_request, gated, items, until


class CountingLoop:
    """The running loop, counting the timers a connection asks it for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.timers: list[asyncio.TimerHandle] = []

    def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        handle = self._loop.call_at(when, callback, *args)
        self.timers.append(handle)
        return handle

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        handle = self._loop.call_later(delay, callback, *args)
        self.timers.append(handle)
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


async def _connected(
    timeout_keep_alive_s: float, timed_by: Callable[[asyncio.AbstractEventLoop], Any]
) -> AsyncIterator[tuple[Connection, Transport, Any, Setup]]:
    s, repository = await gated(timeout_keep_alive_s=timeout_keep_alive_s)
    protocol = s.server.connection()
    loop = timed_by(protocol.loop)
    protocol.loop = loop  # type: ignore[assignment]
    transport = Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    try:
        yield protocol, transport, loop, s
    finally:
        await repository.stop()


async def _answered(protocol: Connection, transport: Transport, count: int) -> None:
    protocol.data_received(binary_request(1.0))
    await until(lambda: len(items(transport)) == count)


@pytest.fixture
async def connected() -> AsyncIterator[tuple[Connection, Transport, CountingLoop, Setup]]:
    async for value in _connected(5.0, CountingLoop):
        yield value


@pytest.fixture
async def short() -> AsyncIterator[tuple[Connection, Transport, FakeLoop, Setup]]:
    """A connection with a keep-alive time of 0.2 s, on a fake clock."""
    async for value in _connected(0.2, FakeLoop):
        yield value


# -- the head's limits -----------------------------------------------------------------


def test_a_head_within_the_limits_is_taken() -> None:
    assert head_refusal(MAX_HEAD_BYTES - 1, 0, MAX_HEADER_FIELDS) is None
    assert head_refusal(100, MAX_HEAD_BYTES - 100, 3) is None


@pytest.mark.parametrize(
    ("target", "fields", "num_fields", "status"),
    [
        (10, 10, MAX_HEADER_FIELDS + 1, 431),
        (MAX_HEAD_BYTES, 0, 1, 414),
        (100, MAX_HEAD_BYTES, 1, 431),
    ],
)
def test_a_head_past_a_limit_is_refused_naming_it(
    target: int, fields: int, num_fields: int, status: int
) -> None:
    refusal = head_refusal(target, fields, num_fields)
    assert refusal is not None and refusal[0] == status
    assert "limit" in refusal[1]


# -- read-ahead --------------------------------------------------------------------------


async def test_pipelined_requests_are_read_ahead_up_to_a_bound(setup: Setup) -> None:
    """Was: reading paused on the first pipelined request, so a client that hung up then
    was never seen and its queued request reached the model (tests/integration/
    test_fault_mix.py)."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0))
    await until(lambda: setup.model.running == 1)
    for i in range(READ_AHEAD_REQUESTS - 1):
        protocol.data_received(binary_request(float(i)))
        assert transport.reading, i
    protocol.data_received(binary_request(2.0))
    assert not transport.reading
    setup.model.open.set()
    await until(lambda: len(items(transport)) == READ_AHEAD_REQUESTS + 1)
    assert transport.reading


# -- the waits -------------------------------------------------------------------------


async def test_a_busy_connection_arms_one_timer_not_one_per_answer(connected: Any) -> None:
    protocol, transport, loop, _ = connected
    for count in range(1, 51):
        await _answered(protocol, transport, count)
    assert [status for status, _, _ in items(transport)] == [200] * 50
    assert len(loop.timers) == 1, f"{len(loop.timers)} timers for 50 answers"
    assert protocol._timer.deadline is not None  # waiting for the next request


async def test_an_idle_connection_closes_a_timeout_after_its_last_answer(short: Any) -> None:
    protocol, transport, loop, _ = short  # timeout_keep_alive_s = 0.2 s
    await _answered(protocol, transport, 1)
    await loop.advance(0.12)
    await _answered(protocol, transport, 2)
    await loop.advance(0.12)  # past the first answer's 0.2 s, within the second's
    assert not transport.closed, "closed by the wait the second request ended"
    await loop.advance(0.07)  # 0.19 s after the last answer
    assert not transport.closed
    await loop.advance(0.02)  # 0.21 s
    assert transport.closed


async def test_a_lost_connection_cancels_its_timer(connected: Any) -> None:
    protocol, transport, loop, _ = connected
    await _answered(protocol, transport, 1)
    protocol.connection_lost(None)
    assert loop.timers and all(timer.cancelled() for timer in loop.timers)
    assert protocol._timer.deadline is None


async def test_keep_alive_timer_is_not_armed_while_a_pipelined_request_runs(
    short_keep_alive: Setup,
) -> None:
    """Was: a request answered inside data_received (here a 400) armed uvicorn's keep-alive
    timer from on_response_complete while the parser went on to the next pipelined
    request, which then ran with the timer armed. Each request's start now disarms it."""
    s = short_keep_alive  # timeout_keep_alive_s = 0.05 s
    s.model.open.clear()
    protocol, _ = s.connect()
    protocol.data_received(BAD + binary_request(3.0))
    assert protocol._timer.deadline is None, "timer armed with a request in flight"


async def test_keep_alive_timeout_does_not_close_under_a_running_request(
    short_keep_alive: Setup,
) -> None:
    """Was (the consequence of the test above): the keep-alive timer closed the connection
    while the model ran, and the pipelined request's answer was lost."""
    s = short_keep_alive
    s.model.open.clear()
    loop = FakeLoop(asyncio.get_running_loop())
    protocol, transport = s.connect_on(loop)
    protocol.data_received(BAD + binary_request(3.0))
    await until(lambda: s.model.running == 1)
    await loop.advance(0.2)  # > timeout_keep_alive_s
    assert not transport.closed
    s.model.open.set()
    await until(lambda: len(items(transport)) == 2)
    assert not transport.closed and not transport.writes_after_close
    statuses = [status for status, _, _ in items(transport)]
    assert statuses == [400, 200]


async def test_keep_alive_timer_after_a_fast_answer(short_keep_alive: Setup) -> None:
    loop = FakeLoop(asyncio.get_running_loop())
    protocol, transport = short_keep_alive.connect_on(loop)  # timeout_keep_alive_s = 0.05 s
    protocol.data_received(binary_request(1.0))
    await until(lambda: bool(items(transport)))
    await loop.advance(0.04)
    assert not transport.closed
    await loop.advance(0.02)
    assert transport.closed  # an idle connection closed after its keep-alive wait


async def test_a_pipelined_body_that_stalls_once_its_turn_comes_gets_408(setup: Setup) -> None:
    """Was: uvicorn's on_response_complete cancels the timer a body's read armed and
    arms none when it starts the next pipelined request, so a body pipelined behind a
    running request that stopped arriving kept its connection open for ever (the
    stalled-body deadline held only for a request that was not pipelined)."""
    setup.model.open.clear()  # the first request stays in the model
    protocol, transport = setup.connect()
    second = binary_request(4.0)
    protocol.data_received(binary_request(1.0) + second[:-4])  # the 2nd body's end never comes
    await until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await until(lambda: len(items(transport)) == 1)
    assert protocol._timer.deadline is not None, "nothing times the stalled body"
    protocol._wait_expired()  # what the timer does at the deadline
    assert transport.closed
    (first, _, _), (status, _, body) = items(transport)
    assert (first, status) == (200, 408)
    assert "request body did not arrive in full" in orjson.loads(body)["error"]


async def test_a_pipelined_request_sent_whole_is_answered_after_a_fired_timer(
    setup: Setup,
) -> None:
    """The body timer of a request pipelined behind a running one may fire while that one
    runs (the server's turn): nothing is refused, and both are answered."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    second = binary_request(4.0)
    protocol.data_received(binary_request(1.0) + second[:-4])
    await until(lambda: setup.model.running == 1)
    protocol.data_received(second[-4:])
    protocol._wait_expired()  # fired while the first request runs
    assert not transport.closed
    setup.model.open.set()
    await until(lambda: len(items(transport)) == 2)
    assert [s for s, _, _ in items(transport)] == [200, 200]
    assert not transport.closed
