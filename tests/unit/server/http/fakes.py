"""Fakes for driving carpool's HTTP protocol without sockets: transports, a reader of
what the server wrote, models, request builders and servers of connections."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httptools
import numpy as np
import orjson

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, TimerHandle
from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.app import KServeApp
from carpool.server.http.connection import Connection
from carpool.server.http.server import HttpServer
from carpool.server.limits import ServerLimits
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
T = TypeVar("T")


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return False  # no half-close: a lingering close closes at once

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0  # every write taken at once

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Transport(FakeTransport):
    """FakeTransport that remembers whether reading is paused and ignores writes once
    closed (as asyncio's transports do once the connection is lost)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.writes_after_close = 0

    def write(self, data: bytes) -> None:
        if self.closed:
            self.writes_after_close += 1
            return
        super().write(data)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Responses:
    """Parses what the server wrote into (status, headers, body) responses."""

    def __init__(self, data: bytes) -> None:
        self.items: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self._headers: dict[bytes, bytes] = {}
        self._body = bytearray()
        self._parser = httptools.HttpResponseParser(self)
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.items.append((self._parser.get_status_code(), self._headers, bytes(self._body)))
        self._headers, self._body = {}, bytearray()


def items(transport: FakeTransport) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    return Responses(bytes(transport.data)).items


class Recorder:
    """A doubling model that records the rows it saw."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.batches: list[int] = []

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen += inputs["x"][:, 0].tolist()
        self.batches.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


class Gate:
    """A doubling model that holds every batch while ``open`` is clear."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.seen: list[float] = []
        self.running = 0

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.running += 1
        try:
            await self.open.wait()
        finally:
            self.running -= 1
        self.seen += inputs["x"][:, 0].tolist()
        return {"y": inputs["x"] * 2}


class FakeLoop:
    """The running loop with a fake clock: ``time()`` reads a FakeClock, and the timers of
    ``call_at``/``call_later`` fire in time order as :meth:`advance` moves it; all else
    (futures, tasks, ``call_soon``) is the loop's. A connection given it as its ``loop``
    times its waits (keep-alive, a body's time, lingering) on the test's clock."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.clock = FakeClock()

    def time(self) -> float:
        return self.clock.now()

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> TimerHandle:
        return self.clock.call_at(when, functools.partial(callback, *args))

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> TimerHandle:
        return self.call_at(self.time() + delay, callback, *args)

    async def advance(self, delta_s: float) -> None:
        """Move the clock by ``delta_s``, firing the timers due, the loop settled after each."""
        await self.clock.advance(delta_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


def connector(
    server: HttpServer, transport_type: Callable[[], T], loop: FakeLoop | None = None
) -> Callable[[], tuple[Connection, T]]:
    """Connections of ``server``, each on a new transport; with ``loop``, timed by it."""

    def connect() -> tuple[Connection, T]:
        protocol = server.connection()
        if loop is not None:
            protocol.loop = loop  # type: ignore[assignment]  # its waits on the test's clock
        transport = transport_type()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return protocol, transport

    return connect


Server = tuple[KServeApp, Callable[[], tuple[Connection, FakeTransport]], Recorder]
SPEC_IN, SPEC_OUT = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))


@contextlib.asynccontextmanager
async def serving(
    access: Access = DEFAULT_ACCESS, clock: FakeClock | None = None
) -> AsyncIterator[Server]:
    """A doubling model "m" served by the fast path, and "custom" (its own infer); with
    ``clock``, the batcher of "m" and the time of the server's reads are that clock's."""
    model = Recorder()
    policy = BatchPolicy(max_batch_size=10_000, max_delay_s=0.001)
    batcher = Batcher(model, policy, collate="dict", clock=clock)
    served = ServedModel("m", "1", "python", (SPEC_IN,), (SPEC_OUT,), batcher)

    async def embed(payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        return {"y": payload["x"] * 3}

    custom = ServedModel("custom", "1", "python", (SPEC_IN,), (SPEC_OUT,), Batcher(model), embed)
    repository = ModelRepository([served, custom])
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000, access=access)
    server = HttpServer(app) if clock is None else HttpServer(app, monotonic=clock.now)
    try:
        yield app, connector(server, FakeTransport), model
    finally:
        await repository.stop()


class Setup:
    """Model "m" (a Gate) served, its connections on Transports."""

    def __init__(self, server: HttpServer, model: Gate, batcher: Batcher) -> None:
        self.server, self.app, self.model, self.batcher = server, server.app, model, batcher
        self.connect = connector(server, Transport)

    def connect_on(self, loop: FakeLoop) -> tuple[Connection, Transport]:
        """A connection whose waits ``loop``'s clock times."""
        return connector(self.server, Transport, loop)()


async def gated(
    timeout_keep_alive_s: float = 5.0,
    access_log: bool = False,
    limits: ServerLimits | None = None,
) -> tuple[Setup, ModelRepository]:
    model = Gate()
    batcher = Batcher(model, BatchPolicy(max_batch_size=10_000, max_delay_s=0.001), collate="dict")
    served = ServedModel("m", "1", "python", (SPEC_IN,), (SPEC_OUT,), batcher)
    repository = ModelRepository([served])
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000, limits=limits)
    server = HttpServer(app, timeout_keep_alive_s=timeout_keep_alive_s, access_log=access_log)
    return Setup(server, model, batcher), repository


def binary_request(
    value: float, *, rows: int = 1, path: bytes = b"/v2/models/m/infer", extra: bytes = b""
) -> bytes:
    data = np.full((rows, 2), value, dtype=np.float32).tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [rows, 2],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    )
    body = header + data
    return (
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
        b"Inference-Header-Content-Length: %d\r\n%s\r\n" % (path, len(body), len(header), extra)
    ) + body


def json_request(document: Any, path: bytes = b"/v2/models/m/infer") -> bytes:
    body = orjson.dumps(document)
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path, len(body)) + body


def binary_output(response: tuple[int, dict[bytes, bytes], bytes]) -> np.ndarray:
    status, headers, body = response
    assert status == 200, body
    length = int(headers[b"inference-header-content-length"])
    header = orjson.loads(body[:length])
    assert header["outputs"][0]["name"] == "y"
    return np.frombuffer(body[length:], dtype=np.float32).reshape(header["outputs"][0]["shape"])


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Polls: the fast path answers from a future's callback, not from anything awaitable."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


BAD = json_request({"inputs": []})  # decodes to a 400 on the spot, without the model
