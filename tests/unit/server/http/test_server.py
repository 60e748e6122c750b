"""The listening side (carpool.server.http.server): connections accepted in bursts and
their first bytes read at once, a stop that lets accepted requests be answered, and the
shared state of a server's connections. Real loopback sockets, the server on the test's
event loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import settle
from carpool.server.app import KServeApp
from carpool.server.http import server as server_module
from carpool.server.http.server import HttpServer
from carpool.server.repository import ModelRepository, ServedModel

from .fakes import LIVE, SPEC_IN, SPEC_OUT, FakeTransport, Gate, binary_request, items, until


@pytest.fixture
async def gate() -> AsyncIterator[Gate]:
    yield Gate()


@pytest.fixture
async def http(gate: Gate) -> AsyncIterator[HttpServer]:
    batcher = Batcher(gate, BatchPolicy(max_batch_size=64, max_delay_s=0.0), collate="dict")
    repository = ModelRepository(
        [ServedModel("m", "1", "python", (SPEC_IN,), (SPEC_OUT,), batcher)]
    )
    await repository.start()
    server = HttpServer(KServeApp(repository, max_body_bytes=100_000))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server.start([listener])
    try:
        yield server
    finally:
        gate.open.set()
        server.cut()
        server.close()
        await repository.stop()


def _client(server: HttpServer) -> socket.socket:
    client = socket.create_connection(server.addresses[0])
    client.setblocking(False)
    return client


async def _read_answer(client: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        return await loop.sock_recv(client, 65536)


async def test_a_burst_of_connections_is_accepted_and_served(http: HttpServer) -> None:
    clients = [_client(http) for _ in range(300)]
    try:
        await until(lambda: http.num_accepted == 300 and len(http.connections) == 300)
        clients[0].sendall(LIVE)
        assert (await _read_answer(clients[0])).startswith(b"HTTP/1.1 200 OK\r\n")
        accepted = next(iter(http.connections))._transport.get_extra_info("socket")
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for client in clients:
            client.close()


async def test_at_most_a_burst_per_readiness(
    http: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "MAX_ACCEPTS_PER_TURN", 2)
    clients = [_client(http) for _ in range(5)]
    try:
        await until(lambda: http.num_accepted == 5)  # the rest on later turns
    finally:
        for client in clients:
            client.close()


async def test_a_request_sent_with_the_connection_is_answered_from_its_first_read(
    http: HttpServer,
) -> None:
    """The server reads a new connection's first bytes as it accepts it: the probe is
    answered as the transport is made, not once the socket is reported readable."""
    protocol = http.connection(first_read=LIVE)
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    ((status, _, _),) = items(transport)
    assert status == 200


async def test_a_stopped_server_accepts_no_more(http: HttpServer) -> None:
    address = http.addresses[0]
    http.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address).close()
    assert http.num_accepted == 0


async def test_a_shutdown_closes_idle_connections_and_answers_the_busy_ones(
    http: HttpServer, gate: Gate
) -> None:
    gate.open.clear()
    idle, busy = _client(http), _client(http)
    try:
        busy.sendall(binary_request(1.0))
        await until(lambda: gate.running == 1)
        stopping = asyncio.ensure_future(http.shutdown(grace_s=30))
        assert await _read_answer(idle) == b""  # closed without a word
        await settle()
        assert len(http.connections) == 1  # the busy one is still being answered
        assert not stopping.done()
        gate.open.set()
        answer = await _read_answer(busy)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close\r\n" in answer
        async with asyncio.timeout(5):
            await stopping
        assert not http.connections
    finally:
        idle.close()
        busy.close()


async def test_a_shutdown_past_its_grace_cuts_what_is_left(http: HttpServer, gate: Gate) -> None:
    gate.open.clear()
    busy = _client(http)
    try:
        busy.sendall(binary_request(1.0, path=b"/v2/models/m/infer?via=handler"))
        await until(lambda: gate.running == 1 and bool(http.tasks))
        async with asyncio.timeout(5):
            await http.shutdown(grace_s=0.1)
        await until(lambda: not http.connections and not http.tasks)
        assert await _read_answer(busy) == b""
    finally:
        busy.close()
