"""Review of a day's changes to the server: the HTTP fast path's connection timers.

Timers are driven by hand (the handler the timer would call), never waited for. The
tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from .test_fasthttp import Responses, _binary_request, _until
from .test_fasthttp_protocol import Setup, _setup


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s, repository = await _setup()
    try:
        yield s
    finally:
        s.model.open.set()
        await repository.stop()


async def test_a_pipelined_body_that_stalls_once_its_turn_comes_gets_408(setup: Setup) -> None:
    """Was: uvicorn's on_response_complete cancels the timer a body's read armed and
    arms none when it starts the next pipelined request, so a body pipelined behind a
    running request that stopped arriving kept its connection open for ever (the
    stalled-body deadline held only for a request that was not pipelined)."""
    setup.model.open.clear()  # the first request stays in the model
    protocol, transport = setup.connect()
    second = _binary_request(4.0)
    protocol.data_received(_binary_request(1.0) + second[:-4])  # the 2nd body's end never comes
    await _until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 1)
    assert protocol._wait_deadline is not None, "nothing times the stalled body"
    protocol.timeout_keep_alive_handler()  # what the timer does at the deadline
    assert transport.closed
    (first, _, _), (status, _, body) = Responses(bytes(transport.data)).items
    assert (first, status) == (200, 408)
    assert "request body did not arrive in full" in orjson.loads(body)["error"]


async def test_a_pipelined_request_sent_whole_is_answered_after_a_fired_timer(
    setup: Setup,
) -> None:
    """The body timer of a request pipelined behind a running one may fire while that one
    runs (the server's turn): nothing is refused, and both are answered."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    second = _binary_request(4.0)
    protocol.data_received(_binary_request(1.0) + second[:-4])
    await _until(lambda: setup.model.running == 1)
    protocol.data_received(second[-4:])
    protocol.timeout_keep_alive_handler()  # fired while the first request runs
    assert not transport.closed
    setup.model.open.set()
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 2)
    assert [s for s, _, _ in Responses(bytes(transport.data)).items] == [200, 200]
    assert not transport.closed
