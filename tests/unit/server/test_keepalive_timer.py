"""The keep-alive wait timed lazily: one loop timer per connection, not one per answer.

Was: uvicorn armed a timer (``loop.call_later``) for every answer and cancelled it when
the next request began, 1.3 us a request with uvloop. Now an answer only moves the wait's
deadline; the one timer, when it fires, sleeps on to the deadline of the wait then
running. What the timer decides is unchanged: an idle connection still closes
timeout_keep_alive after its last answer, never under a request being answered."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from carpool.server.fasthttp import InferProtocol, protocol_for

from .test_fasthttp import Responses, _binary_request, _until
from .test_fasthttp_protocol import Setup, Transport, _setup


class CountingLoop:
    """The running loop, counting the timers a protocol asks it for."""

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
    timeout_keep_alive: float,
) -> AsyncIterator[tuple[InferProtocol, Transport, CountingLoop, Setup]]:
    s, repository = await _setup(timeout_keep_alive=timeout_keep_alive)
    config = uvicorn.Config(
        s.app,
        http=protocol_for(s.app),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
    )
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    loop = CountingLoop(protocol.loop)
    protocol.loop = loop
    transport = Transport()
    protocol.connection_made(transport)
    try:
        yield protocol, transport, loop, s
    finally:
        await repository.stop()


async def _answered(protocol: InferProtocol, transport: Transport, count: int) -> None:
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: len(Responses(bytes(transport.data)).items) == count)


@pytest.fixture
async def connected() -> AsyncIterator[tuple[InferProtocol, Transport, CountingLoop, Setup]]:
    async for value in _connected(5.0):
        yield value


@pytest.fixture
async def short() -> AsyncIterator[tuple[InferProtocol, Transport, CountingLoop, Setup]]:
    async for value in _connected(0.2):
        yield value


async def test_a_busy_connection_arms_one_timer_not_one_per_answer(connected: Any) -> None:
    protocol, transport, loop, _ = connected
    for count in range(1, 51):
        await _answered(protocol, transport, count)
    assert [status for status, _, _ in Responses(bytes(transport.data)).items] == [200] * 50
    assert len(loop.timers) == 1, f"{len(loop.timers)} timers for 50 answers"
    assert protocol._wait_deadline is not None  # waiting for the next request


async def test_an_idle_connection_closes_a_timeout_after_its_last_answer(short: Any) -> None:
    protocol, transport, _, _ = short  # timeout_keep_alive = 0.2 s
    await _answered(protocol, transport, 1)
    await asyncio.sleep(0.12)
    await _answered(protocol, transport, 2)
    last_answer = time.monotonic()
    await asyncio.sleep(0.12)  # past the first answer's 0.2 s, within the second's
    assert not transport.closed, "closed by the wait the second request ended"
    await _until(lambda: transport.closed, timeout_s=2.0)
    waited = time.monotonic() - last_answer
    assert 0.19 <= waited < 1.0, waited


async def test_a_lost_connection_cancels_its_timer(connected: Any) -> None:
    protocol, transport, loop, _ = connected
    await _answered(protocol, transport, 1)
    protocol.connection_lost(None)
    assert loop.timers and all(timer.cancelled() for timer in loop.timers)
    assert protocol._wait_timer is None
