"""The HTTP infer fast path: uvicorn's protocol fed raw HTTP/1.1 bytes by a fake transport.

Every test checks the wire bytes a client would read, and where a request went (the fast
path answers without an ASGI task; everything else must still reach the app).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httptools
import numpy as np
import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from carpool import Batcher, BatchPolicy
from carpool.server.access import DEFAULT_ACCESS, Access
from carpool.server.app import KServeApp
from carpool.server.fasthttp import InferProtocol, protocol_for
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec


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

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


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


class Recorder:
    """A doubling model that records the rows it saw."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.batches: list[int] = []

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.seen += inputs["x"][:, 0].tolist()
        self.batches.append(len(inputs["x"]))
        return {"y": inputs["x"] * 2}


Server = tuple[KServeApp, Callable[[], tuple[InferProtocol, FakeTransport]], Recorder]


T = TypeVar("T")


def connector(
    config: uvicorn.Config, transport_type: Callable[[], T]
) -> Callable[[], tuple[InferProtocol, T]]:
    """Connections to the protocol of ``config`` (loaded here), each on a new transport;
    all share one server state, as a server's connections do."""
    config.load()
    state = ServerState()

    def connect() -> tuple[InferProtocol, T]:
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        transport = transport_type()
        protocol.connection_made(transport)  # type: ignore[attr-defined]
        assert isinstance(protocol, InferProtocol)
        return protocol, transport

    return connect


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as served:
        yield served


@contextlib.asynccontextmanager
async def serving(access: Access = DEFAULT_ACCESS) -> AsyncIterator[Server]:
    """A doubling model "m" served by the fast path, and "custom" (its own infer)."""
    model = Recorder()
    batcher = Batcher(model, BatchPolicy(max_batch_size=10_000, max_delay_s=0.001), collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)

    async def embed(payload: dict[str, np.ndarray], options: dict[str, Any]) -> Any:
        return {"y": payload["x"] * 3}

    custom = ServedModel("custom", "1", "python", (spec_in,), (spec_out,), Batcher(model), embed)
    repository = ModelRepository([served, custom])
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000, access=access)
    config = uvicorn.Config(app, http=protocol_for(app), lifespan="off", log_level="warning")
    try:
        yield app, connector(config, FakeTransport), model
    finally:
        await repository.stop()


def _binary_request(
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


def _json_request(document: Any, path: bytes = b"/v2/models/m/infer") -> bytes:
    body = orjson.dumps(document)
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path, len(body)) + body


def _binary_output(response: tuple[int, dict[bytes, bytes], bytes]) -> np.ndarray:
    status, headers, body = response
    assert status == 200, body
    length = int(headers[b"inference-header-content-length"])
    header = orjson.loads(body[:length])
    assert header["outputs"][0]["name"] == "y"
    return np.frombuffer(body[length:], dtype=np.float32).reshape(header["outputs"][0]["shape"])


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Polls: the fast path answers from a future's callback, not from anything awaitable."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def test_binary_infer_is_answered_in_one_write_without_a_task(server: Server) -> None:
    _, connect, model = server
    protocol, transport = connect()
    writes: list[bytes] = []
    transport.write = writes.append  # type: ignore[method-assign]
    protocol.data_received(_binary_request(1.5))
    assert not protocol.server_state.tasks  # no ASGI task was started for it
    await _until(lambda: bool(writes))
    assert len(writes) == 1
    (response,) = Responses(writes[0]).items
    np.testing.assert_array_equal(_binary_output(response), [[3.0, 3.0]])
    assert int(response[1][b"content-length"]) == len(response[2])
    assert model.seen == [1.5]


async def test_concurrent_connections_share_a_batch(server: Server) -> None:
    _, connect, model = server
    connections = [connect() for _ in range(6)]
    for i, (protocol, _) in enumerate(connections):
        protocol.data_received(_binary_request(float(i)))
    await _until(lambda: all(t.data for _, t in connections))
    for i, (_, transport) in enumerate(connections):
        (response,) = Responses(bytes(transport.data)).items
        np.testing.assert_array_equal(_binary_output(response), [[2.0 * i, 2.0 * i]])
    assert max(model.batches) > 1


async def test_bad_request_gets_400_and_its_batch_neighbours_succeed(server: Server) -> None:
    _, connect, _ = server
    good, bad = connect(), connect()
    good[0].data_received(_binary_request(2.0))
    wrong_shape = {
        "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]
    }
    bad[0].data_received(_json_request(wrong_shape))
    await _until(lambda: bool(good[1].data and bad[1].data))
    ((status, _, body),) = Responses(bytes(bad[1].data)).items
    assert status == 400
    assert "input 'x': shape [1, 3], expected [-1, 2]" in orjson.loads(body)["error"]
    np.testing.assert_array_equal(_binary_output(Responses(bytes(good[1].data)).items[0]), [[4, 4]])
    assert not bad[1].closed  # a 400 keeps the connection


async def test_json_request_gets_a_json_answer(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    document = {
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    protocol.data_received(_json_request(document))
    await _until(lambda: bool(transport.data))
    ((status, headers, body),) = Responses(bytes(transport.data)).items
    assert status == 200 and headers[b"content-type"] == b"application/json"
    output = orjson.loads(body)["outputs"][0]
    assert output == {"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [2, 4, 6, 8]}


async def test_other_routes_and_models_go_through_the_asgi_app(server: Server) -> None:
    _, connect, _ = server
    requests = {
        "metadata": b"GET /v2/models/m HTTP/1.1\r\nHost: t\r\n\r\n",
        "unknown model": _binary_request(1.0, path=b"/v2/models/nope/infer"),
        "custom infer": _binary_request(1.0, path=b"/v2/models/custom/infer"),
        "version": _binary_request(1.0, path=b"/v2/models/m/versions/1/infer"),
        "wrong version": _binary_request(1.0, path=b"/v2/models/m/versions/9/infer"),
        "query": _binary_request(1.0, path=b"/v2/models/m/infer?trace=1"),
    }
    transports = {}
    for name, raw in requests.items():
        protocol, transports[name] = connect()
        protocol.data_received(raw)
    await _until(lambda: all(t.data for t in transports.values()))
    answers = {name: Responses(bytes(t.data)).items[0] for name, t in transports.items()}
    assert orjson.loads(answers["metadata"][2])["name"] == "m"
    assert answers["unknown model"][0] == 404
    assert "model 'nope'" in orjson.loads(answers["unknown model"][2])["error"]
    np.testing.assert_array_equal(_binary_output(answers["custom infer"]), [[3, 3]])
    np.testing.assert_array_equal(_binary_output(answers["version"]), [[2, 2]])
    assert answers["wrong version"][0] == 404
    np.testing.assert_array_equal(_binary_output(answers["query"]), [[2, 2]])


async def test_infer_routes_are_remembered_only_for_served_models(server: Server) -> None:
    """The fast path keeps each infer URL it served with its model, so a later request
    skips parsing the path. Answers are the same the second time round, and URLs that
    name no served model (any client can send thousands) are never kept."""
    app, connect, _ = server
    paths = [b"/v2/models/nope-%d/infer" % i for i in range(100)]
    paths += [b"/v2/models/m/versions/%d/infer" % i for i in range(2, 100)]
    paths += [b"/v2/models/m/infer", b"/v2/models/m/versions/1/infer"]
    paths += [b"/v2/models/custom/infer", b"/v2/models/m/infer?x=1", b"/v2/models/m//infer"]
    rounds = []
    for _ in range(2):
        transports = []
        for path in paths:
            protocol, transport = connect()
            protocol.data_received(_binary_request(1.0, path=path))
            transports.append(transport)
        await _until(lambda: all(t.data for t in transports))  # noqa: B023
        rounds.append([Responses(bytes(t.data)).items[0][0] for t in transports])
    assert rounds[0] == rounds[1]
    assert rounds[0][:198] == [404] * 198 and rounds[0][198:202] == [200] * 4
    assert set(app.infer_routes) <= {
        b"/v2/models/m/infer",
        b"/v2/models/m/versions/1/infer",
        b"/v2/models/custom/infer",
    }


async def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(
        _binary_request(1.0) + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
        + _binary_request(5.0)
    )  # fmt: skip
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 3)
    first, live, last = Responses(bytes(transport.data)).items
    np.testing.assert_array_equal(_binary_output(first), [[2, 2]])
    assert live[0] == 200
    np.testing.assert_array_equal(_binary_output(last), [[10, 10]])


async def test_body_in_many_chunks_and_larger_than_uvicorns_high_water_mark(
    server: Server,
) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    raw = _binary_request(0.5, rows=8000)  # 64 KB of tensor data, past 64 KiB in all
    for start in range(0, len(raw), 1000):
        protocol.data_received(raw[start : start + 1000])
    await _until(lambda: bool(transport.data))
    output = _binary_output(Responses(bytes(transport.data)).items[0])
    assert output.shape == (8000, 2) and np.all(output == 1.0)


@pytest.mark.parametrize(
    "path",
    [b"/v2/models/m/infer", b"/v2/models/m/infer?x=1"],  # the fast path, then uvicorn's ASGI path
)
async def test_body_over_the_limit_gets_413_and_the_connection_closes(
    server: Server, path: bytes
) -> None:
    # Was: uvicorn's ASGI path kept the connection and read the rest of the body on (a
    # 64 MiB limit let a client make it read any amount); both paths now close.
    _, connect, model = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0, rows=20_000, path=path))  # 160 KB > 100 KB
    await _until(lambda: transport.closed)
    ((status, headers, body),) = Responses(bytes(transport.data)).items
    assert status == 413 and headers[b"connection"] == b"close"
    assert "100000" in orjson.loads(body)["error"]
    assert transport.closed
    assert model.seen == []


async def test_a_gzip_body_that_inflates_past_the_limit_keeps_the_connection(
    server: Server,
) -> None:
    # Read in full, only too large once inflated: a 413, and the connection goes on.
    import gzip

    _, connect, _ = server
    protocol, transport = connect()
    raw = _json_request(
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0.0] * 60_000}]},
        path=b"/v2/models/m/infer?a=1",
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    packed = gzip.compress(body)  # about 200 KB inflated, far less sent
    head = head.replace(b"Content-Length: %d" % len(body), b"Content-Length: %d" % len(packed))
    protocol.data_received(head + b"\r\nContent-Encoding: gzip\r\n\r\n" + packed)
    await _until(lambda: bool(transport.data))
    ((status, headers, _),) = Responses(bytes(transport.data)).items
    assert status == 413 and headers.get(b"connection") != b"close"
    transport.data.clear()
    protocol.data_received(_binary_request(2.0))
    await _until(lambda: bool(transport.data))
    np.testing.assert_array_equal(
        _binary_output(Responses(bytes(transport.data)).items[0]), [[4, 4]]
    )
    assert not transport.closed


async def test_connection_close_is_honoured(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0, extra=b"Connection: close\r\n"))
    await _until(lambda: transport.closed)
    (response,) = Responses(bytes(transport.data)).items
    assert response[1][b"connection"] == b"close"
    np.testing.assert_array_equal(_binary_output(response), [[2, 2]])


async def test_expect_100_continue_is_answered_before_the_body(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    raw = _binary_request(1.0, extra=b"Expect: 100-continue\r\n")
    head, body = raw.split(b"\r\n\r\n", 1)
    protocol.data_received(head + b"\r\n\r\n")
    assert bytes(transport.data) == b"HTTP/1.1 100 Continue\r\n\r\n"
    protocol.data_received(body)
    await _until(lambda: len(transport.data) > 25)
    (response,) = Responses(bytes(transport.data)[25:]).items
    np.testing.assert_array_equal(_binary_output(response), [[2, 2]])


async def test_a_client_that_leaves_withdraws_its_queued_request(server: Server) -> None:
    app, connect, model = server
    batcher = app.repository.get("m").batcher
    batcher.update_policy(max_delay_s=0.2)  # the request stays queued for a while
    protocol, transport = connect()
    protocol.data_received(_binary_request(7.0))
    await _until(lambda: batcher.num_pending == 1)
    protocol.connection_lost(None)
    await asyncio.sleep(0.3)
    assert batcher.num_pending == 0
    assert 7.0 not in model.seen
    assert transport.data == b""
    rejections = batcher.snapshot().classes["normal"].rejections
    assert rejections["cancelled"] == 1


async def test_answer_heads_are_shared_until_the_default_headers_change(server: Server) -> None:
    """Answers of one shape share their status line and header fields; uvicorn replaces
    its default headers (the date) every second, and the next answer carries the new."""
    _, connect, _ = server
    protocol, transport = connect()
    state = protocol.server_state
    state.default_headers = [(b"date", b"Mon, 01 Jan 2026 00:00:00 GMT")]
    for value in (1.0, 2.0):
        protocol.data_received(_binary_request(value))
        await _until(lambda: len(Responses(bytes(transport.data)).items) == int(value))  # noqa: B023
    state.default_headers = [(b"date", b"Mon, 01 Jan 2026 00:00:01 GMT"), (b"server", b"x")]
    protocol.data_received(_binary_request(3.0))
    protocol.data_received(_binary_request(4.0, extra=b"Connection: close\r\n"))
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 4)
    items = Responses(bytes(transport.data)).items
    assert [item[1][b"date"] for item in items] == [
        b"Mon, 01 Jan 2026 00:00:00 GMT",
        b"Mon, 01 Jan 2026 00:00:00 GMT",
        b"Mon, 01 Jan 2026 00:00:01 GMT",
        b"Mon, 01 Jan 2026 00:00:01 GMT",
    ]
    assert b"server" not in items[1][1] and items[2][1][b"server"] == b"x"
    assert b"connection" not in items[2][1] and items[3][1][b"connection"] == b"close"
    assert [_binary_output(item)[0, 0] for item in items] == [2.0, 4.0, 6.0, 8.0]
    assert transport.closed


async def test_a_request_deadline_counts_from_its_first_byte(server: Server) -> None:
    # timeout 200 ms (Triton's parameter, in µs); the body trickles in over 300 ms: it is
    # past its deadline before it is parsed, and never reaches the model.
    _, connect, model = server
    protocol, transport = connect()
    document = {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [7.0, 7.0]}],
        "parameters": {"timeout": 200_000},
    }
    request = _json_request(document)
    protocol.data_received(request[:-5])
    await asyncio.sleep(0.3)
    protocol.data_received(request[-5:])
    await _until(lambda: bool(transport.data))
    ((status, _, body),) = Responses(bytes(transport.data)).items
    assert status == 503, body
    assert b"past its timeout" in body
    assert 7.0 not in model.seen


@contextlib.asynccontextmanager
async def _bounded(max_queue_size: int) -> AsyncIterator[tuple[InferProtocol, Recorder, Any]]:
    """A served model whose replica is held, with a queue bound: the first request
    runs, the next ``max_queue_size`` wait, and the rest are refused."""
    gate = asyncio.Event()
    model = Recorder()

    async def held(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        await gate.wait()
        return await model(inputs)

    policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, max_queue_size=max_queue_size)
    batcher = Batcher(held, policy, collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    repository = ModelRepository(
        [ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)]
    )
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000)
    config = uvicorn.Config(app, http=protocol_for(app), lifespan="off", log_level="warning")
    connect = connector(config, FakeTransport)
    try:
        yield connect, model, gate
    finally:
        gate.set()
        await repository.stop()


async def test_a_full_queue_refuses_from_the_head_without_decoding_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _bounded(max_queue_size=1) as (connect, model, gate):
        for value in (1.0, 2.0):  # one runs (held), one waits
            connect()[0].data_received(_binary_request(value))
            await asyncio.sleep(0.01)
        decoded: list[bytes] = []
        from carpool.server import fasthttp

        real = fasthttp.prepare_infer
        monkeypatch.setattr(
            fasthttp, "prepare_infer", lambda m, body, *a: decoded.append(body) or real(m, body, *a)
        )
        protocol, transport = connect()
        # Refused once its head is in: the answer does not wait for the body.
        request = _binary_request(3.0)
        head_end = request.index(b"\r\n\r\n") + 4
        protocol.data_received(request[:head_end])
        protocol.data_received(request[head_end:])
        protocol.data_received(_binary_request(4.0))  # and again on the same connection
        responses = Responses(bytes(transport.data)).items
        assert [r[0] for r in responses] == [429, 429]
        _, headers, body = responses[0]
        assert headers[b"retry-after"] == b"1"
        assert b"is full" in body
        assert not transport.closed  # the body was read: the connection stays usable
        assert decoded == []
        gate.set()
        await _until(lambda: len(model.seen) == 2)
        # Room again: the same connection is served.
        protocol.data_received(_binary_request(5.0))
        await _until(lambda: len(Responses(bytes(transport.data)).items) == 3)
        assert Responses(bytes(transport.data)).items[2][0] == 200
        assert model.seen == [1.0, 2.0, 5.0]


KEY = b"s3cr3t-k3y"


async def test_an_infer_without_the_api_key_is_a_401_never_decoded_nor_queued() -> None:
    async with serving(Access(KEY.decode())) as (_, connect, model):
        undecodable = (
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\n{nope"
        )
        requests = [
            undecodable,  # a 400 if it were decoded
            _binary_request(1.0),
            _binary_request(2.0, extra=b"Authorization: Bearer wrong\r\n"),
            _binary_request(3.0, extra=b"Authorization: " + KEY + b"\r\n"),  # no scheme
        ]
        transports = []
        for raw in requests:
            protocol, transport = connect()
            protocol.data_received(raw)
            transports.append(transport)
        await _until(lambda: all(t.data for t in transports))
        for transport in transports:
            ((status, headers, body),) = Responses(bytes(transport.data)).items
            assert status == 401, body
            assert headers[b"www-authenticate"] == b"Bearer"
            assert b"Authorization: Bearer <key>" in body and KEY not in body
        assert model.seen == []


async def test_an_infer_with_the_api_key_takes_the_fast_path_and_its_repeats() -> None:
    async with serving(Access(KEY.decode())) as (_, connect, model):
        protocol, transport = connect()
        keyed = _binary_request(1.5, extra=b"authorization: bearer " + KEY + b"\r\n")
        protocol.data_received(keyed)
        assert not protocol.server_state.tasks  # the fast path: no ASGI task
        await _until(lambda: bool(transport.data))
        protocol.data_received(keyed + keyed)  # the head kept: taken without the parser
        await _until(lambda: len(Responses(bytes(transport.data)).items) == 3)
        protocol.data_received(_binary_request(9.0, extra=b"authorization: bearer k\r\n"))
        await _until(lambda: len(Responses(bytes(transport.data)).items) == 4)
        statuses = [status for status, _, _ in Responses(bytes(transport.data)).items]
        assert statuses == [200, 200, 200, 401]
        assert model.seen == [1.5, 1.5, 1.5]


async def test_a_refused_connection_is_not_read_until_its_model_has_room() -> None:
    async with _bounded(max_queue_size=1) as (connect, model, gate):
        for value in (1.0, 2.0):  # one runs (held), one waits
            connect()[0].data_received(_binary_request(value))
            await asyncio.sleep(0.01)
        refused, refused_transport = connect()
        refused.data_received(_binary_request(3.0))
        assert Responses(bytes(refused_transport.data)).items[0][0] == 429
        assert refused.flow.read_paused  # its retry waits in the socket, costing nothing
        room = refused.kserve.waiting_room
        assert room.num_waiting == 1
        gate.set()
        await _until(lambda: not refused.flow.read_paused)
        assert room.num_waiting == 0
        refused.data_received(_binary_request(4.0))  # the retry, read once there is room
        await _until(lambda: len(Responses(bytes(refused_transport.data)).items) == 2)
        assert Responses(bytes(refused_transport.data)).items[1][0] == 200
        assert 4.0 in model.seen


async def test_a_waiting_connection_keeps_its_place_from_newcomers() -> None:
    async with _bounded(max_queue_size=2) as (connect, model, gate):
        queued = []
        for value in (1.0, 2.0, 3.0):  # one runs (held), two wait in the queue
            protocol, _ = connect()
            protocol.data_received(_binary_request(value))
            queued.append(protocol)
            await asyncio.sleep(0.01)
        waiting, _ = connect()
        waiting.data_received(_binary_request(4.0))
        assert waiting.flow.read_paused  # refused: it waits for room
        queued[2].connection_lost(None)  # a place frees: the waiting connection's
        newcomer, newcomer_transport = connect()
        newcomer.data_received(_binary_request(5.0))
        assert Responses(bytes(newcomer_transport.data)).items[0][0] == 429
        await _until(lambda: not waiting.flow.read_paused)
        assert newcomer.flow.read_paused  # behind it
        waiting.data_received(_binary_request(6.0))  # its retry has the place
        gate.set()
        await _until(lambda: 6.0 in model.seen)
        assert 5.0 not in model.seen


async def test_a_connection_waits_for_room_at_most_its_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from carpool.server import waiting

    monkeypatch.setattr(waiting, "MAX_WAIT_S", 0.05)
    async with _bounded(max_queue_size=1) as (connect, _, _):
        for value in (1.0, 2.0):  # one runs (held), one waits: no room for a long while
            connect()[0].data_received(_binary_request(value))
            await asyncio.sleep(0.01)
        refused, refused_transport = connect()
        refused.data_received(_binary_request(3.0))
        assert refused.flow.read_paused
        await _until(lambda: not refused.flow.read_paused)  # read again: a health probe
        refused.data_received(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")  # is answered
        await _until(lambda: len(Responses(bytes(refused_transport.data)).items) == 2)
        assert Responses(bytes(refused_transport.data)).items[1][0] == 200


async def test_health_probes_are_answered_without_a_task_in_their_turn(server: Server) -> None:
    app, connect, _ = server
    protocol, transport = connect()
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
    ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    protocol.data_received(_binary_request(1.0) + ready + live)  # behind an infer
    assert not protocol.server_state.tasks  # no ASGI task: nothing to queue behind
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 3)
    statuses = [status for status, _, _ in Responses(bytes(transport.data)).items]
    assert statuses == [200, 200, 200]  # in order: the infer's answer first
    assert not transport.closed
    await app.repository.stop()  # not ready any more; still alive
    protocol.data_received(ready + live)
    await _until(lambda: len(Responses(bytes(transport.data)).items) == 5)
    assert [status for status, _, _ in Responses(bytes(transport.data)).items][3:] == [503, 200]
