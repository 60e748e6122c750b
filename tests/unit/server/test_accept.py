"""Acceptor: connections accepted in bursts beside the loop's own accept."""

from __future__ import annotations

import asyncio
import socket
from typing import ClassVar

import pytest

from carpool.server import accept
from carpool.server.accept import Acceptor


class Echo(asyncio.Protocol):
    made: ClassVar[list[Echo]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        Echo.made.append(self)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def test_a_burst_of_connections_is_accepted_in_one_turn() -> None:
    loop = asyncio.get_running_loop()
    listener = _listener()
    Echo.made = []
    acceptor = Acceptor(loop, [listener], Echo)  # no loop server: only the acceptor
    clients = [socket.create_connection(listener.getsockname()) for _ in range(300)]
    try:
        async with asyncio.timeout(5):
            while len(Echo.made) < 300:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert acceptor.num_accepted == 300
        clients[0].sendall(b"ping")
        clients[0].settimeout(5)
        assert await loop.run_in_executor(None, clients[0].recv, 4) == b"ping"
        nodelay = Echo.made[0].transport.get_extra_info("socket")
        assert nodelay.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        acceptor.stop()
        for client in clients:
            client.close()
        listener.close()


async def test_at_most_a_burst_per_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept, "MAX_ACCEPTS_PER_TURN", 2)
    loop = asyncio.get_running_loop()
    listener = _listener()
    Echo.made = []
    acceptor = Acceptor(loop, [listener], Echo)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(5)]
    try:
        async with asyncio.timeout(5):
            while len(Echo.made) < 5:  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # the rest on later turns
    finally:
        acceptor.stop()
        for client in clients:
            client.close()
        listener.close()


async def test_stopped_it_accepts_no_more() -> None:
    loop = asyncio.get_running_loop()
    listener = _listener()
    acceptor = Acceptor(loop, [listener], Echo)
    acceptor.stop()
    client = socket.create_connection(listener.getsockname())  # queued by the kernel only
    try:
        await asyncio.sleep(0.1)
        assert acceptor.num_accepted == 0
    finally:
        client.close()
        listener.close()
