"""A lean HTTP/1.1 client for the load generator, and a Server-Sent Events parser.

The load generator must not be the bottleneck it measures, so the hot path is small:
requests are encoded to bytes once, up front; each is one ``transport.write`` on an idle
keep-alive connection; httptools (llhttp, in C) parses the response, Content-Length or
chunked; the answer is one future. No per-request header dicts, URL parsing or
streams. Connections are opened on demand up to ``max_connections``; beyond that a
request waits for one to come free (and that wait shows up as lag in the generator).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from carpool.errors import ConfigError

ChunkSink = Callable[[bytes], None]


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes
    sent_s: float  # when the request was written (the clock of the client)


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/prefix`` as (host, port, path prefix without a trailing slash)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError("target", url, "an http://host:port URL (https is not supported)")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def host_header(host: str, port: int | None = None) -> str:
    """The ``Host`` value for ``host`` (and ``port``): an IPv6 address in brackets, as a
    URL writes it (RFC 9112 3.2; ``urlsplit().hostname`` drops them)."""
    named = f"[{host}]" if ":" in host else host
    return named if port is None else f"{named}:{port}"


def encode_request(
    method: str,
    host: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bytes:
    """A complete HTTP/1.1 keep-alive request, ready to write as it is."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    head = "\r\n".join(lines) + "\r\n\r\n"
    return head.encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self._on_lost = on_lost
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[int] | None = None
        self._chunks: list[bytes] = []
        self._sink: ChunkSink | None = None
        self.is_open = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.is_open = True

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionError(f"malformed HTTP response from the server: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_open = False
        self._fail(ConnectionError("the server closed the connection before answering"))
        self._on_lost(self)

    # -- httptools callbacks --
    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink(body)
        else:
            self._chunks.append(body)

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.is_open = False  # answered; closed once the caller has the answer
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._parser.get_status_code())

    # -- the client's side --
    def send(self, data: bytes, sink: ChunkSink | None) -> asyncio.Future[int]:
        assert self._transport is not None and self._waiter is None
        self._chunks = []
        self._sink = sink
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        self._transport.write(data)
        return waiter

    def take_body(self) -> bytes:
        chunks, self._chunks = self._chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        self.is_open = False
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


class HttpClient:
    """Keep-alive connections to one ``host:port``, at most ``max_connections`` of them."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_connections < 1:
            raise ConfigError("max_connections", max_connections, "an integer >= 1")
        self.host = host
        self.port = port
        self._max_connections = max_connections
        self._clock = clock
        self._idle: list[_Connection] = []
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._connections: set[_Connection] = set()
        self._num_opening = 0

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def request(self, data: bytes, sink: ChunkSink | None = None) -> HttpResponse:
        """Write ``data`` (a whole encoded request) and await the answer.

        With ``sink``, body chunks go to it as they arrive (a stream) and the returned body
        is empty. Raises ConnectionError (or OSError) when the connection fails.
        """
        connection = self._idle.pop() if self._idle else await self._acquire()
        try:
            sent_s = self._clock()
            status = await connection.send(data, sink)
            body = connection.take_body()
        except BaseException:
            connection.close()
            raise
        self._release(connection)
        return HttpResponse(status, body, sent_s)

    async def get(self, path: str) -> HttpResponse:
        """A one-off GET (metadata, /metrics): encoded here, not on any hot path."""
        return await self.request(encode_request("GET", host_header(self.host), path))

    async def close(self) -> None:
        for connection in list(self._connections):
            connection.close()
        self._idle.clear()
        for waiter in self._waiting:
            waiter.cancel()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    async def _acquire(self) -> _Connection:
        while True:
            if self._idle:
                return self._idle.pop()
            if len(self._connections) + self._num_opening < self._max_connections:
                return await self._open()
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()

    async def _open(self) -> _Connection:
        self._num_opening += 1
        try:
            loop = asyncio.get_running_loop()
            _, protocol = await loop.create_connection(
                lambda: _Connection(self._forget), self.host, self.port
            )
        finally:
            self._num_opening -= 1
        self._connections.add(protocol)
        return protocol

    def _release(self, connection: _Connection) -> None:
        if connection.is_open:
            self._idle.append(connection)
        else:
            connection.close()
        self._wake_one()

    def _forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class SseParser:
    """Server-Sent Events: feed body chunks, get back each complete event's ``data``.

    Events end with a blank line (``\\n\\n`` or ``\\r\\n\\r\\n``); several ``data:`` lines
    of one event are joined with ``\\n``; comments (``:``) and other fields are skipped.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        events: list[bytes] = []
        while (end := buffer.find(b"\n\n")) >= 0:
            block, buffer = buffer[:end], buffer[end + 2 :]
            data = [_field_value(line) for line in block.split(b"\n") if _is_data(line)]
            if data:
                events.append(b"\n".join(data))
        self._buffer = buffer
        return events


def _is_data(line: bytes) -> bool:
    return line == b"data" or line.startswith(b"data:")


def _field_value(line: bytes) -> bytes:
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value


def json_error_message(body: bytes) -> str:
    """A short reason from an error body (KServe ``error`` or OpenAI ``error.message``)."""
    import orjson

    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode("utf-8", "replace")
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error)[:200] if error is not None else ""
