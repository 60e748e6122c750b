"""A front-end worker (carpool.server.workers.worker) on its own, its engine played by
the test's end of a socket pair and two rings."""

from __future__ import annotations

import asyncio
import logging
import socket
from multiprocessing import shared_memory

import pytest

from carpool.server.limits import ServerLimits
from carpool.server.workers import worker
from carpool.server.workers.ring import Ring

RING_BYTES = 1 << 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for _ in range(200):
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
    raise AssertionError(f"the worker never listened on port {port}")


async def test_requests_waiting_on_an_engine_that_dies_are_answered_503_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's end closes while a forwarded request waits for its answer: the client
    gets a 503 at once (not after the drain's timeout, nor a connection closed without an
    answer), and the worker ends."""
    monkeypatch.setattr(worker, "freeze_startup_heap", lambda: None)  # not in the test run
    port = _free_port()
    to_engine = Ring(None, RING_BYTES, create=True)
    to_worker = Ring(None, RING_BYTES, create=True)
    flags = shared_memory.SharedMemory(create=True, size=1)
    engine_end, worker_end = socket.socketpair()
    spec = worker.WorkerSpec(
        index=0,
        host="127.0.0.1",
        port=port,
        grpc_port=None,
        sock=worker_end,
        to_engine=to_engine.name,
        to_worker=to_worker.name,
        ring_bytes=RING_BYTES,
        ready_flags=flags.name,
        models=(),
        max_request_bytes=1 << 20,
        limits=ServerLimits(),
        api_key=None,
        protect_metrics=False,
        allow_policy_updates=False,
        drain_timeout_s=30.0,
        log_level=logging.WARNING,
    )
    serving = asyncio.ensure_future(worker._serve(spec))
    try:
        reader, writer = await _connect(port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # forwarded to the engine
        await writer.drain()
        await asyncio.sleep(0.2)  # it waits for the engine's answer
        engine_end.close()  # the engine dies
        head = await asyncio.wait_for(reader.readline(), 5.0)
        assert head.startswith(b"HTTP/1.1 503"), head
        await asyncio.wait_for(serving, 10.0)
        writer.close()
    finally:
        serving.cancel()
        for ring in (to_engine, to_worker):
            ring.close()
        flags.close()
        flags.unlink()
