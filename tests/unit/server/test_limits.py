"""Server limits (carpool.server.limits): open connections, request bytes held across
connections, and the time a body may take, enforced by the HTTP protocol fed raw bytes
(carpool.server.http)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy, ConfigError
from carpool.core.clock import settle
from carpool.server.app import KServeApp
from carpool.server.http.connection import Connection
from carpool.server.http.server import HttpServer
from carpool.server.limits import InflightBytes, ServerLimits
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .http.fakes import (
    FakeLoop,
    FakeTransport,
    Recorder,
    Responses,
    binary_request,
    connector,
    until,
)

Connect = Callable[[], tuple[Connection, FakeTransport]]


@contextlib.asynccontextmanager
async def limited(
    limits: ServerLimits, *, gate: asyncio.Event | None = None, loop: FakeLoop | None = None
) -> AsyncIterator[tuple[KServeApp, Connect, Recorder]]:
    """Model "m" (doubling; held while ``gate`` is clear) served under ``limits``; with
    ``loop``, its connections' waits are timed by that loop's fake clock."""
    model = Recorder()

    async def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if gate is not None:
            await gate.wait()
        return await model(inputs)

    batcher = Batcher(run, BatchPolicy(max_batch_size=64, max_delay_s=0.0), collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)
    repository = ModelRepository([served])
    await repository.start()
    app = KServeApp(repository, max_body_bytes=1_000_000, limits=limits)
    try:
        yield app, connector(HttpServer(app, timeout_keep_alive_s=5), FakeTransport, loop), model
    finally:
        if gate is not None:
            gate.set()
        await repository.stop()


# -- the values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_connections", 0), ("max_inflight_bytes", -1), ("max_connections", True),
     ("body_timeout_s", 0.0), ("body_timeout_s", float("inf"))],
)  # fmt: skip
def test_limits_are_checked_when_built(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        ServerLimits(**{field: value})


def test_the_budget_refuses_past_its_bytes_and_takes_them_back() -> None:
    budget = InflightBytes(100)
    assert budget.take(60)
    assert not budget.take(50)
    assert budget.take(40)
    budget.release(60)
    budget.release(40)
    assert budget.held_bytes == 0
    assert budget.num_refused == 1


def test_one_request_larger_than_the_budget_still_runs_alone() -> None:
    budget = InflightBytes(100)
    assert budget.take(500)  # --max-request-bytes bounds one request, not this
    assert not budget.take(1)


# -- connections ----------------------------------------------------------------------


async def test_a_connection_past_the_cap_gets_503_with_retry_after_and_is_closed() -> None:
    async with limited(ServerLimits(max_connections=2)) as (_, connect, model):
        within = [connect() for _ in range(2)]
        over, over_transport = connect()
        over.data_received(binary_request(9.0))
        ((status, headers, body),) = Responses(bytes(over_transport.data)).items
        assert status == 503
        assert headers[b"retry-after"] == b"1"
        assert b"--max-connections" in body
        assert over_transport.closed
        protocol, transport = within[0]
        protocol.data_received(binary_request(1.0))
        await until(lambda: bool(transport.data))
        assert Responses(bytes(transport.data)).items[0][0] == 200
        assert model.seen == [1.0]


# -- bytes held -----------------------------------------------------------------------


async def test_requests_past_the_bytes_held_get_503_and_keep_their_connection() -> None:
    gate = asyncio.Event()
    one = len(binary_request(1.0).split(b"\r\n\r\n", 1)[1])  # a body's bytes
    async with limited(ServerLimits(max_inflight_bytes=2 * one), gate=gate) as (app, connect, _):
        held = [connect() for _ in range(2)]
        for i, (protocol, _) in enumerate(held):
            protocol.data_received(binary_request(float(i)))
        await settle()
        assert app.inflight.held_bytes == 2 * one  # held until answered
        protocol, transport = connect()
        protocol.data_received(binary_request(5.0))
        ((status, headers, body),) = Responses(bytes(transport.data)).items
        assert (status, headers[b"retry-after"]) == (503, b"1")
        assert b"--max-inflight-bytes" in body
        assert not transport.closed
        scrape = app.metrics.render()[0].decode()
        assert f"carpool_inflight_bytes {float(2 * one)}" in scrape
        assert "carpool_refused_inflight_bytes_total 1.0" in scrape
        gate.set()
        await until(lambda: all(t.data for _, t in held))
        assert app.inflight.held_bytes == 0
        protocol.data_received(binary_request(6.0))  # room again, same connection
        await until(lambda: len(Responses(bytes(transport.data)).items) == 2)
        assert Responses(bytes(transport.data)).items[1][0] == 200


async def test_a_chunked_body_is_held_as_it_comes() -> None:
    async with limited(ServerLimits(max_inflight_bytes=1000)) as (app, connect, _):
        protocol, transport = connect()
        protocol.data_received(
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        protocol.data_received(b"258\r\n" + b"a" * 600 + b"\r\n")
        assert app.inflight.held_bytes == 600
        other, other_transport = connect()
        other.data_received(binary_request(1.0)[:-1])  # its head declares what it holds
        held_now = app.inflight.held_bytes
        protocol.data_received(b"1f4\r\n" + b"b" * 500 + b"\r\n0\r\n\r\n")
        ((status, _, _),) = Responses(bytes(transport.data)).items
        assert status == 503
        assert app.inflight.held_bytes == held_now - 600  # its bytes went back
        other.connection_lost(None)
        assert app.inflight.held_bytes == 0
        assert not other_transport.data


async def test_a_lost_connection_gives_back_what_its_requests_held() -> None:
    gate = asyncio.Event()
    async with limited(ServerLimits(), gate=gate) as (app, connect, _):
        protocol, _ = connect()
        protocol.data_received(binary_request(1.0) * 3)  # one running, two pipelined
        await settle()
        assert app.inflight.held_bytes > 0
        protocol.connection_lost(None)
        assert app.inflight.held_bytes == 0


# -- body time ------------------------------------------------------------------------


async def test_a_body_trickled_past_the_body_timeout_gets_408() -> None:
    # Each byte comes well within the keep-alive wait (5 s), so only the whole body's
    # time limit can end it.
    loop = FakeLoop(asyncio.get_running_loop())
    async with limited(ServerLimits(body_timeout_s=0.3), loop=loop) as (_, connect, model):
        protocol, transport = connect()
        request = binary_request(1.0)
        head_end = request.index(b"\r\n\r\n") + 4
        protocol.data_received(request[:head_end])
        for i in range(head_end, head_end + 5):  # a byte each 0.05 s
            protocol.data_received(request[i : i + 1])
            await loop.advance(0.05)
        assert not transport.data  # 0.25 s after the head: within its 0.3 s
        protocol.data_received(request[head_end + 5 : head_end + 6])
        await loop.advance(0.06)  # 0.31 s after the head
        ((status, _, body),) = Responses(bytes(transport.data)).items
        assert status == 408
        assert b"--body-timeout-s" in body
        assert transport.closed
        assert model.seen == []
