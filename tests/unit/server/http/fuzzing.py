"""The harness of the protocol's fuzz tests (test_connection_fuzz.py): requests of every
kind and modifier, hypothesis strategies for them, a reader of what the server wrote, a
transport that behaves as asyncio's, a model the test holds, and a server of connections
on a fake clock."""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httptools
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock
from carpool.server.app import KServeApp
from carpool.server.http.connection import Connection
from carpool.server.http.server import HttpServer
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .fakes import binary_request, json_request

MAX_BODY_BYTES = 2_000
TOO_LARGE_ROWS = 300  # 2,400 bytes of tensor data
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- requests ---------------------------------------------------------------------------

FAST_KINDS = (
    "binary",
    "json",
    "version",
    "bad_json",
    "bad_binary",  # its JSON header said to be longer than the body
    "too_large",
    "model_error",  # the model raises for its row
)
ROUTE_KINDS = (  # answered by the route's handler
    "query",  # the infer route with a query string
    "query_bad",
    "query_too_large",
    "gzip",  # the infer route, body gzipped: the handler inflates it
    "unknown",  # no such model: 404
    "empty_version",  # /v2/models/m/versions//infer: 404
    "ready",
    "metadata",
)
KINDS = FAST_KINDS + ROUTE_KINDS
GET_KINDS = {"ready", "metadata"}


@dataclass(frozen=True)
class Spec:
    kind: str
    is_close: bool = False
    is_expect: bool = False
    is_http10: bool = False
    is_chunked: bool = False

    @property
    def is_fast(self) -> bool:
        """Taken by the fast path, not a route's handler."""
        return self.kind in FAST_KINDS


def _insert_headers(raw: bytes, headers: bytes) -> bytes:
    line_end = raw.index(b"\r\n") + 2
    return raw[:line_end] + headers + raw[line_end:]


def _chunked(raw: bytes) -> bytes:
    head, body = raw.split(b"\r\n\r\n", 1)
    head = re.sub(rb"\r\nContent-Length: \d+", b"", head) + b"\r\nTransfer-Encoding: chunked"
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 97]), body[i : i + 97]) for i in range(0, len(body), 97)
    )
    return head + b"\r\n\r\n" + chunks + b"0\r\n\r\n"


def build(spec: Spec, value: float) -> bytes:
    """The request's bytes; ``value`` fills its tensor, so the model's rows name it."""
    kind = spec.kind
    path = b"/v2/models/m/infer"
    if kind in ("query", "query_bad", "query_too_large"):
        path += b"?q=1"
    elif kind == "version":
        path = b"/v2/models/m/versions/1/infer"
    elif kind == "unknown":
        path = b"/v2/models/nope/infer"
    elif kind == "empty_version":
        path = b"/v2/models/m/versions//infer"
    if kind == "ready":
        raw = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    elif kind == "metadata":
        raw = b"GET /v2/models/m HTTP/1.1\r\nHost: t\r\n\r\n"
    elif kind == "json":
        tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
        raw = json_request({"inputs": [tensor]}, path=path)
    elif kind in ("bad_json", "query_bad"):
        raw = json_request({"inputs": []}, path=path)
    elif kind == "bad_binary":
        raw = binary_request(value, path=path)
        raw = re.sub(rb"Header-Content-Length: \d+", b"Header-Content-Length: 9999", raw)
    elif kind == "model_error":
        raw = binary_request(-value, path=path)
    elif kind == "gzip":
        head, body = binary_request(value, path=path).split(b"\r\n\r\n", 1)
        body = gzip.compress(body, mtime=0)
        head = re.sub(rb"Content-Length: \d+", b"Content-Length: %d" % len(body), head)
        raw = head + b"\r\nContent-Encoding: gzip\r\n\r\n" + body
    elif kind in ("too_large", "query_too_large"):
        raw = binary_request(value, rows=TOO_LARGE_ROWS, path=path)
    else:
        raw = binary_request(value, path=path)
    extra = b""
    if spec.is_close:
        extra += b"Connection: close\r\n"
    if spec.is_expect:
        extra += b"Expect: 100-continue\r\n"
    raw = _insert_headers(raw, extra)
    if spec.is_chunked and kind not in GET_KINDS:
        raw = _chunked(raw)
    if spec.is_http10:
        raw = raw.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    return raw


MODIFIERS = ("close", "expect", "http10", "chunked")


@st.composite
def request_lists(
    draw: st.DrawFn, kinds: tuple[str, ...], modifiers: tuple[str, ...], size: tuple[int, int]
) -> list[Spec]:
    """Swarm testing: each run draws from a few of the kinds and modifiers, so that runs of,
    say, only 413s and chunked bodies come up as often as even mixes."""
    kinds = tuple(draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4, unique=True)))
    allowed = set(draw(st.lists(st.sampled_from(modifiers), unique=True))) if modifiers else set()

    def flag(name: str) -> bool:
        return name in allowed and draw(st.integers(0, 2)) == 0

    def spec(kind: str) -> Spec:
        is_get = kind in GET_KINDS
        is_http10 = flag("http10")
        return Spec(
            kind,
            is_close=flag("close"),
            is_expect=flag("expect") and not is_get,
            is_http10=is_http10,
            is_chunked=flag("chunked") and not is_get and not is_http10,
        )

    low, high = size
    return [
        spec(kind) for kind in draw(st.lists(st.sampled_from(kinds), min_size=low, max_size=high))
    ]


# -- what a client reads ------------------------------------------------------------------

Answer = tuple[int, tuple[tuple[bytes, bytes], ...], bytes]  # status, headers, body


class Reader:
    """Parses what the server wrote into answers, 100 Continue included."""

    def __init__(self, data: bytes) -> None:
        self.answers: list[Answer] = []
        self.num_begun = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = bytearray()
        self._parser = httptools.HttpResponseParser(self)
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.num_begun += 1

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"date", b"content-length"):  # the parser checks the length
            self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        # The size a 413 names is what had arrived when the limit was passed: it depends
        # on how the body was cut into reads, on either path. Request ids are counters.
        body = re.sub(rb"request body of \d+ bytes", b"request body of N bytes", self._body)
        body = re.sub(rb"request \d+: ", b"request N: ", body)  # a model error's request id
        status = self._parser.get_status_code()
        self.answers.append((status, tuple(sorted(self._headers)), body))
        self._headers, self._body = [], bytearray()


def _closes(answer: Answer) -> bool:
    return (b"connection", b"close") in answer[1]


# -- a transport as asyncio's, a model the test holds, a server -------------------------


class Transport:
    """asyncio's transport as the protocol sees it: no data is delivered while reading is
    paused (the driver asks ``reading``), past ``high_water_bytes`` of unread answers it
    calls pause_writing (resume_writing when the client reads), and the connection is
    reported lost on the loop turn after close()."""

    def __init__(self, high_water_bytes: int | None) -> None:
        self.data = bytearray()
        self.high_water_bytes = high_water_bytes
        self.protocol: Connection | None = None
        self.reading = True
        self.closed = False
        self.closed_by_client = False
        self.lost = False
        self.write_paused = False
        self.unread_bytes = 0
        self.writes_after_server_close = 0
        self.writes_after_lost = 0

    def write(self, data: bytes) -> None:
        if self.lost:
            self.writes_after_lost += 1  # uvloop raises
            return
        if self.closed:  # dropped, as asyncio drops them
            self.writes_after_server_close += not self.closed_by_client
            return
        self.data += data
        self.unread_bytes += len(data)
        limit = self.high_water_bytes
        if limit is not None and self.unread_bytes > limit and not self.write_paused:
            self.write_paused = True
            assert self.protocol is not None
            self.protocol.pause_writing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def can_write_eof(self) -> bool:
        return False  # no half-close: a lingering close closes at once

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self._lose)

    def abort(self) -> None:
        """Closed now, what is buffered dropped: lost on the next turn, as close()."""
        self.close()

    def get_write_buffer_size(self) -> int:
        """The transport's own buffer: the unread answers past the high-water mark."""
        return self.unread_bytes if self.write_paused else 0

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            assert self.protocol is not None
            self.protocol.connection_lost(None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def client_reads(self) -> None:
        self.unread_bytes = 0
        if self.write_paused and not self.closed:
            self.write_paused = False
            assert self.protocol is not None
            self.protocol.resume_writing()

    def client_hangs_up(self) -> None:
        """EOF from the client: the protocol's eof_received lets the transport close."""
        if not self.closed:
            self.closed_by_client = True
            assert self.protocol is not None
            self.protocol.eof_received()  # it returns None: the transport closes
            self.close()

    def client_resets(self) -> None:
        """The connection reset: lost at once, with the error."""
        if not self.lost:
            self.closed = self.closed_by_client = self.lost = True
            assert self.protocol is not None
            self.protocol.connection_lost(ConnectionResetError())


class Model:
    """Doubles ``x``, raises for a batch with a negative row; a call is held until
    ``release`` when ``holds`` says so. Records the rows it saw, and those it saw after
    the connection was lost."""

    def __init__(self) -> None:
        self.holds: list[bool] = [False]
        self.num_calls = 0
        self.held: list[asyncio.Future[None]] = []
        self.seen: list[float] = []
        self.seen_after_lost: list[float] = []
        self.transport: Transport | None = None

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = inputs["x"][:, 0].tolist()
        self.seen += rows
        if self.transport is not None and self.transport.lost:
            self.seen_after_lost += rows
        if min(rows) < 0:
            raise ValueError("a negative row")
        is_held = self.holds[self.num_calls % len(self.holds)]
        self.num_calls += 1
        if is_held:
            gate = asyncio.get_running_loop().create_future()
            self.held.append(gate)
            await gate
        return {"y": inputs["x"] * 2}

    def release(self, num: int = 1) -> None:
        for _ in range(min(num, len(self.held))):
            self.held.pop(0).set_result(None)


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(self.format(record))


@dataclass
class Server:
    app: KServeApp
    model: Model
    batcher: Batcher
    clock: FakeClock
    http: HttpServer  # its connections share it
    errors: list[str] = field(default_factory=list)

    def connect(self, high_water_bytes: int | None = None) -> tuple[Connection, Transport]:
        """A new connection, as the server makes one."""
        protocol = self.http.connection()
        transport = Transport(high_water_bytes)
        transport.protocol = protocol
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return protocol, transport

    async def tick(self) -> None:
        """Time moves past the batching delay; the loop runs what is ready."""
        await self.clock.advance(0.001)


@contextmanager
def _watched(server: Server) -> Iterator[None]:
    """Exceptions raised in loop callbacks and errors the server logs land in
    server.errors."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: server.errors.append(repr(context)))
    handler = Errors()
    logger = logging.getLogger("carpool.server")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        server.errors += handler.messages


async def _server(max_delay_s: float) -> tuple[Server, ModelRepository]:
    model, clock = Model(), FakeClock()
    policy = BatchPolicy(max_batch_size=10_000, max_delay_s=max_delay_s)
    batcher = Batcher(model, policy, collate="dict", clock=clock)
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    repository = ModelRepository(
        [ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)]
    )
    await repository.start()
    app = KServeApp(repository, max_body_bytes=MAX_BODY_BYTES)
    # The keep-alive timer is real time: never here.
    http = HttpServer(app, timeout_keep_alive_s=3600)
    return Server(app, model, batcher, clock, http), repository


# -- reads of a stream ------------------------------------------------------------------

chunk_sizes = st.one_of(st.integers(1, 400), st.integers(400, 8000))


def _cut(stream: bytes, sizes: list[int]) -> list[bytes]:
    chunks, start, i = [], 0, 0
    while start < len(stream):
        chunks.append(stream[start : start + sizes[i % len(sizes)]])
        start += sizes[i % len(sizes)]
        i += 1
    return chunks


def _group(raws: list[bytes], sizes: list[int]) -> list[bytes]:
    """Reads of 1-3 whole requests each (by ``sizes``)."""
    chunks, start, i = [], 0, 0
    while start < len(raws):
        count = sizes[i % len(sizes)] % 3 + 1
        chunks.append(b"".join(raws[start : start + count]))
        start += count
        i += 1
    return chunks


# -- Accept-Encoding ----------------------------------------------------------------------

ACCEPT_ITEMS = st.one_of(
    st.sampled_from(
        [
            b"gzip",
            b"GZIP",
            b"x-gzip",
            b"deflate",
            b"DeFlate",
            b"identity",
            b"*",
            b"br",
            b"zstd",
            b"",
            b" ",
            b";",
            b"gzip;q=0",
            b"gzip;q=0.5",
            b"deflate;q=1.0",
            b"identity;q=0",
            b"*;q=0",
            b"gzip;q=nan",
            b"gzip;q=inf",
            b"deflate;q=-1",
            b"gzip;q=2",
            b"gzip; Q=0.001",
            b"deflate;q=1e-9",
            b"gzip;q=",
            b"gzip;level=9;q=0.3",
            b"deflate ; q = 0.7",
        ]
    ),
    # Garbage a header value may carry: visible ASCII, spaces, tabs and obs-text.
    st.binary(max_size=10).map(
        lambda raw: bytes(b if 0x20 <= b < 0x7F or b >= 0x80 else 0x61 for b in raw)
    ),
)
HEADER_NAMES = [b"Accept-Encoding", b"accept-encoding", b"ACCEPT-ENCODING", b"aCcEpT-eNcOdInG"]


@st.composite
def accept_fields(draw: st.DrawFn) -> list[bytes]:
    """Zero or more Accept-Encoding field lines, each a list of codings."""
    fields = []
    for _ in range(draw(st.integers(0, 3))):
        separator = draw(st.sampled_from([b",", b", ", b" ,", b",,"]))
        value = separator.join(draw(st.lists(ACCEPT_ITEMS, min_size=1, max_size=4)))
        fields.append(draw(st.sampled_from(HEADER_NAMES)) + b": " + value.strip(b" \t"))
    return fields


SIZED_KINDS = ("binary", "json", "bad", "model_error", "too_large")


@dataclass(frozen=True)
class Sized:
    kind: str
    rows: int
    fields: tuple[bytes, ...]


def _request(item: Sized, value: float, *, by_handler: bool, accept: bool = True) -> bytes:
    """The request's bytes; the route's handler takes the same route with a query."""
    path = b"/v2/models/m/infer" + (b"?q=1" if by_handler else b"")
    if item.kind == "json":
        tensor = {"name": "x", "shape": [item.rows, 2], "datatype": "FP32"}
        tensor["data"] = [value] * (2 * item.rows)
        raw = json_request({"inputs": [tensor]}, path=path)
    elif item.kind == "bad":
        raw = json_request({"inputs": []}, path=path)
    elif item.kind == "model_error":
        raw = binary_request(-value, rows=item.rows, path=path)
    elif item.kind == "too_large":
        raw = binary_request(value, rows=300, path=path)
    else:
        raw = binary_request(value, rows=item.rows, path=path)
    if not accept or not item.fields:
        return raw
    return _insert_headers(raw, b"".join(field + b"\r\n" for field in item.fields))


@st.composite
def sized_requests(draw: st.DrawFn) -> list[Sized]:
    kinds = draw(st.lists(st.sampled_from(SIZED_KINDS), min_size=1, max_size=3, unique=True))
    # Mostly rows around the 1 KiB threshold: binary answers of 8 bytes a row, JSON ones
    # of about 8 characters a row.
    rows = st.one_of(st.integers(1, 4), st.integers(110, 160))
    return [
        Sized(kind, draw(rows), tuple(draw(accept_fields())))
        for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=8))
    ]


# -- driving a connection ---------------------------------------------------------------


async def _answers(server: Server, stream: bytes, sizes: list[int]) -> tuple[list[Answer], Any]:
    """The answers to ``stream`` sent on one connection in reads of ``sizes``; the
    client reads all and hangs up once the server is quiet."""
    protocol, transport = server.connect()
    chunks = _cut(stream, sizes)
    num_fed = 0
    for _ in range(200):
        while num_fed < len(chunks) and transport.reading and not transport.closed:
            protocol.data_received(chunks[num_fed])
            num_fed += 1
        transport.client_reads()
        await server.tick()
        is_quiet = not server.batcher.num_pending and not protocol.tasks
        if is_quiet and (num_fed == len(chunks) or transport.closed):
            break
    reader = Reader(bytes(transport.data))
    assert reader.num_begun == len(reader.answers), "an answer was cut short"
    assert (transport.writes_after_server_close, transport.writes_after_lost) == (0, 0)
    if not transport.closed:
        assert num_fed == len(chunks), "reading stalled"
        transport.client_hangs_up()
    await server.tick()
    return reader.answers, transport
