"""The HTTP infer fast path held to uvicorn's own ASGI path and to RFC 9112: ordering of
pipelined answers, keep-alive, back-pressure, what follows a 413, header and path corner
cases. The tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import uvicorn

from carpool import Batcher, BatchPolicy
from carpool.server.app import KServeApp
from carpool.server.fasthttp import READ_AHEAD_REQUESTS, InferProtocol, protocol_for
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec

from .test_fasthttp import (
    FakeTransport,
    Responses,
    _binary_output,
    _binary_request,
    _json_request,
    _until,
    connector,
)

LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
BAD = _json_request({"inputs": []})  # decodes to a 400 on the spot, without the model


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


class Gate:
    """A doubling model that holds every batch until ``release`` (or runs freely)."""

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


Connect = Callable[[], tuple[InferProtocol, Transport]]


class Setup:
    def __init__(self, app: KServeApp, connect: Connect, model: Gate, batcher: Batcher) -> None:
        self.app, self.connect, self.model, self.batcher = app, connect, model, batcher


async def _setup(
    timeout_keep_alive: float = 5.0, access_log: bool = False
) -> tuple[Setup, ModelRepository]:
    model = Gate()
    batcher = Batcher(model, BatchPolicy(max_batch_size=10_000, max_delay_s=0.001), collate="dict")
    spec_in, spec_out = TensorSpec("x", "FP32", (2,)), TensorSpec("y", "FP32", (2,))
    served = ServedModel("m", "1", "python", (spec_in,), (spec_out,), batcher)
    repository = ModelRepository([served])
    await repository.start()
    app = KServeApp(repository, max_body_bytes=100_000)
    config = uvicorn.Config(
        app,
        http=protocol_for(app),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
        access_log=access_log,
    )
    return Setup(app, connector(config, Transport), model, batcher), repository


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s, repository = await _setup()
    try:
        yield s
    finally:
        s.model.open.set()
        await repository.stop()


@pytest.fixture
async def short_keep_alive() -> AsyncIterator[Setup]:
    s, repository = await _setup(timeout_keep_alive=0.05)
    try:
        yield s
    finally:
        s.model.open.set()
        await repository.stop()


def _items(transport: Transport) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    return Responses(bytes(transport.data)).items


# ---------------------------------------------------------------------------------------
# Confirmed bugs (these fail)
# ---------------------------------------------------------------------------------------


async def test_pipelined_oversized_request_is_answered_after_the_request_before_it(
    setup: Setup,
) -> None:
    """Was: a 413 for a request pipelined behind one still being answered was written at
    once (before the earlier answer) and closed the connection, losing the earlier answer.
    Pipelined requests are answered strictly in order (RFC 9112 9.3.2): the 413 waits for
    its turn."""
    setup.model.open.clear()  # the first request stays in the model
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0) + _binary_request(1.0, rows=20_000))
    await _until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await asyncio.sleep(0.05)
    statuses = [status for status, _, _ in _items(transport)]
    assert statuses == [200, 413]


async def test_keep_alive_timer_is_not_armed_while_a_pipelined_request_runs(
    short_keep_alive: Setup,
) -> None:
    """Was: a request answered inside data_received (here a 400) armed uvicorn's keep-alive
    timer from on_response_complete while the parser went on to the next pipelined
    request, which then ran with the timer armed. Each request's start now disarms it."""
    s = short_keep_alive  # timeout_keep_alive = 0.05 s
    s.model.open.clear()
    protocol, _ = s.connect()
    protocol.data_received(BAD + _binary_request(3.0))
    assert protocol._wait_deadline is None, "timer armed with a request in flight"


async def test_keep_alive_timeout_does_not_close_under_a_running_request(
    short_keep_alive: Setup,
) -> None:
    """Was (the consequence of the test above): the keep-alive timer closed the connection
    while the model ran, and the pipelined request's answer was lost."""
    s = short_keep_alive
    s.model.open.clear()
    protocol, transport = s.connect()
    protocol.data_received(BAD + _binary_request(3.0))
    await _until(lambda: s.model.running == 1)
    await asyncio.sleep(0.2)  # > timeout_keep_alive
    s.model.open.set()
    await asyncio.sleep(0.05)
    assert not transport.writes_after_close
    statuses = [status for status, _, _ in _items(transport)]
    assert statuses == [400, 200]


async def test_many_pipelined_bad_requests_are_all_answered(setup: Setup) -> None:
    """Was: requests pipelined behind one in flight and answered on the spot (decode
    errors, QueueFull, Closed) began each other recursively (_answer ->
    on_response_complete -> _start_asgi_task -> _begin -> _dispatch -> _answer); a few
    hundred hit the recursion limit and the rest were never answered. Each now begins on
    the next loop turn."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    n = 400
    protocol.data_received(_binary_request(1.0) + BAD * n)
    await _until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await _until(lambda: len(_items(transport)) == n + 1, timeout_s=3.0)


@pytest.mark.parametrize("path", [b"/v2/models/m/infer?asgi=1", b"/v2/models/m/infer"])
async def test_no_answers_are_written_while_the_client_does_not_read(
    setup: Setup, path: bytes
) -> None:
    """With the transport's write side paused (the client is not reading), uvicorn's send()
    waits in flow.drain(): nothing more is written and the next request is not started.
    Was: the fast path wrote regardless and resumed reading after every answer, so a client
    that never read made the server buffer answers without bound. It now holds the answer
    until resume_writing."""
    protocol, transport = setup.connect()
    protocol.pause_writing()
    for i in range(3):
        protocol.data_received(_binary_request(float(i), path=path))
        await asyncio.sleep(0.05)
    assert len(_items(transport)) == 0
    protocol.resume_writing()
    await _until(lambda: len(_items(transport)) >= 1)


async def test_data_after_a_413_is_not_served(setup: Setup) -> None:
    """Nothing after a response with connection: close is processed (RFC 9112 9.6). Was:
    the parser went on with the rest of the same read after a 413; the next request got
    its 400 written onto the closed transport, the one after it its 100 Continue, and it
    was queued in the batcher."""
    protocol, transport = setup.connect()
    protocol.data_received(
        _binary_request(1.0, rows=20_000) + BAD
        + _binary_request(9.0, extra=b"Expect: 100-continue\r\n")
    )  # fmt: skip
    written_after_close, queued = transport.writes_after_close, setup.batcher.num_pending
    protocol.connection_lost(None)  # what the loop does after transport.close()
    assert [status for status, _, _ in _items(transport)] == [413]
    assert (written_after_close, queued) == (0, 0)


async def test_duplicate_inference_header_length_is_read_as_on_the_asgi_path(
    setup: Setup,
) -> None:
    """With two Inference-Header-Content-Length headers both paths read the first. Was: the
    fast path read the last, so the same bytes got different answers depending on whether
    the URL carried a query."""
    good = _binary_request(1.0)
    head, body = good.split(b"\r\n\r\n", 1)
    raw_head = head + b"\r\nInference-Header-Content-Length: 7\r\n\r\n"
    answers = {}
    for name, path in {"asgi": b"/v2/models/m/infer?q=1", "fast": b"/v2/models/m/infer"}.items():
        protocol, transport = setup.connect()
        protocol.data_received(raw_head.replace(b"/v2/models/m/infer", path, 1) + body)
        await _until(lambda t=transport: bool(_items(t)))
        answers[name] = _items(transport)[0][0]
    assert answers["fast"] == answers["asgi"]


async def test_empty_version_segment_is_routed_as_on_the_asgi_path(setup: Setup) -> None:
    """``/v2/models/m/versions//infer`` is a 404 on both paths. Was: the fast path passed
    version "" to repository.get, which read it as "any version" and answered 200."""
    answers = {}
    for name, path in {
        "asgi": b"/v2/models/m/versions//infer?q=1",
        "fast": b"/v2/models/m/versions//infer",
    }.items():
        protocol, transport = setup.connect()
        protocol.data_received(_binary_request(1.0, path=path))
        await _until(lambda t=transport: bool(_items(t)))
        answers[name] = _items(transport)[0][0]
    assert answers == {"asgi": 404, "fast": 404}


# ---------------------------------------------------------------------------------------
# Checked and correct (these pass)
# ---------------------------------------------------------------------------------------


async def test_request_fed_one_byte_at_a_time(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = _binary_request(2.5, extra=b"iNfErEnCe-HeAdEr-CoNtEnT-LeNgTh-X: 1\r\n")
    for i in range(len(raw)):
        protocol.data_received(raw[i : i + 1])
    await _until(lambda: bool(_items(transport)))
    np.testing.assert_array_equal(_binary_output(_items(transport)[0]), [[5, 5]])


async def test_lower_case_header_name(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = _binary_request(1.0).replace(
        b"Inference-Header-Content-Length", b"inference-header-content-length"
    )
    protocol.data_received(raw)
    await _until(lambda: bool(_items(transport)))
    np.testing.assert_array_equal(_binary_output(_items(transport)[0]), [[2, 2]])


async def test_chunked_body(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = _binary_request(1.5)
    head, body = raw.split(b"\r\n\r\n", 1)
    head = head.replace(b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked")
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7])
                       for i in range(0, len(body), 7)) + b"0\r\n\r\n"  # fmt: skip
    protocol.data_received(head + b"\r\n\r\n" + chunked + LIVE)
    await _until(lambda: len(_items(transport)) == 2)
    first, live = _items(transport)
    np.testing.assert_array_equal(_binary_output(first), [[3, 3]])
    assert live[0] == 200


async def test_chunked_and_content_length_is_rejected_with_400(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = _binary_request(1.5, extra=b"Transfer-Encoding: chunked\r\n")
    protocol.data_received(raw)
    await asyncio.sleep(0.01)
    (response,) = _items(transport)
    assert response[0] == 400 and transport.closed
    assert setup.model.seen == []


async def test_empty_body_gets_400_and_keeps_the_connection(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\n\r\n" + LIVE
    )
    await _until(lambda: len(_items(transport)) == 3)
    assert [s for s, _, _ in _items(transport)] == [400, 400, 200]
    assert not transport.closed


async def test_http10_without_and_with_keep_alive_closes(setup: Setup) -> None:
    for extra in (b"", b"Connection: keep-alive\r\n"):
        protocol, transport = setup.connect()
        raw = _binary_request(1.0, extra=extra).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        protocol.data_received(raw)
        await _until(lambda t=transport: t.closed)
        (response,) = _items(transport)
        assert response[1][b"connection"] == b"close"
        np.testing.assert_array_equal(_binary_output(response), [[2, 2]])


async def test_request_after_connection_close_is_ignored(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(
        _binary_request(1.0, extra=b"Connection: close\r\n") + _binary_request(8.0)
    )
    await _until(lambda: transport.closed)
    await asyncio.sleep(0.05)
    assert len(_items(transport)) == 1
    assert 8.0 not in setup.model.seen


async def test_pipelined_after_a_400_and_mixed_paths_keep_order(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(
        LIVE + _binary_request(1.0) + BAD + _binary_request(2.0, path=b"/v2/models/m/infer?a=1")
        + _binary_request(3.0) + LIVE
    )  # fmt: skip
    await asyncio.sleep(0.02)
    setup.model.open.set()
    await _until(lambda: len(_items(transport)) == 6)
    statuses = [s for s, _, _ in _items(transport)]
    assert statuses == [200, 200, 400, 200, 200, 200]
    outputs = [_binary_output(r)[0, 0] for r in _items(transport)[1:5] if r[0] == 200]
    assert outputs == [2, 4, 6]


async def test_expect_continue_pipelined_behind_a_running_request(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    second = _binary_request(4.0, extra=b"Expect: 100-continue\r\n")
    head, body = second.split(b"\r\n\r\n", 1)
    protocol.data_received(_binary_request(1.0) + head + b"\r\n\r\n")
    await _until(lambda: setup.model.running == 1)
    assert b"100 Continue" not in transport.data  # not before the first answer
    assert transport.reading  # read ahead (READ_AHEAD_*): a hang-up is still seen
    setup.model.open.set()
    await _until(lambda: b"100 Continue" in transport.data)
    first_end = transport.data.index(b"HTTP/1.1 100 Continue")
    assert len(Responses(bytes(transport.data[:first_end])).items) == 1
    assert transport.reading
    protocol.data_received(body)
    await _until(lambda: len(Responses(bytes(transport.data[first_end + 25 :])).items) == 1)
    (response,) = Responses(bytes(transport.data[first_end + 25 :])).items
    np.testing.assert_array_equal(_binary_output(response), [[8, 8]])


async def test_connection_lost_while_the_model_runs(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: setup.model.running == 1)
    protocol.connection_lost(None)
    setup.model.open.set()
    await asyncio.sleep(0.05)
    assert transport.data == b"" and transport.writes_after_close == 0


async def test_pipelined_requests_are_read_ahead_up_to_a_bound(setup: Setup) -> None:
    """Was: reading paused on the first pipelined request, so a client that hung up then
    was never seen and its queued request reached the model (tests/integration/
    test_fault_mix.py)."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: setup.model.running == 1)
    for i in range(READ_AHEAD_REQUESTS - 1):
        protocol.data_received(_binary_request(float(i)))
        assert transport.reading, i
    protocol.data_received(_binary_request(2.0))
    assert not transport.reading
    setup.model.open.set()
    await _until(lambda: len(_items(transport)) == READ_AHEAD_REQUESTS + 1)
    assert transport.reading


async def test_connection_lost_tells_the_asgi_request_running_ahead_of_a_pipelined_one(
    setup: Setup,
) -> None:
    """Was: uvicorn marked only the newest (pipelined) cycle disconnected; the running ASGI
    request kept its queued request, then wrote to the closed transport (uvloop raises)."""
    setup.batcher.update_policy(max_delay_s=0.2)
    protocol, transport = setup.connect()
    asgi = _binary_request(1.0, path=b"/v2/models/m/infer?via=asgi")
    protocol.data_received(asgi + asgi)
    await _until(lambda: setup.batcher.num_pending == 1)
    protocol.connection_lost(None)
    await _until(lambda: setup.batcher.num_pending == 0)
    await asyncio.sleep(0.3)
    assert setup.model.seen == [] and transport.data == b""
    assert transport.writes_after_close == 0


async def test_connection_lost_with_a_pipelined_request_waiting(setup: Setup) -> None:
    setup.batcher.update_policy(max_delay_s=0.2)
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0) + _binary_request(2.0))
    await _until(lambda: setup.batcher.num_pending == 1)
    protocol.connection_lost(None)
    await asyncio.sleep(0.3)
    assert setup.model.seen == [] and transport.data == b""


async def test_keep_alive_timer_after_a_fast_answer(short_keep_alive: Setup) -> None:
    protocol, transport = short_keep_alive.connect()
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: bool(_items(transport)))
    assert not transport.closed
    await asyncio.sleep(0.15)
    assert transport.closed  # idle connection closed by uvicorn's keep-alive timeout


async def test_shutdown_with_a_request_in_flight_answers_it_then_closes(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: setup.model.running == 1)
    protocol.shutdown()
    assert not transport.closed
    setup.model.open.set()
    await _until(lambda: transport.closed)
    (response,) = _items(transport)
    assert response[1][b"connection"] == b"close"
    np.testing.assert_array_equal(_binary_output(response), [[2, 2]])


async def test_requests_queued_before_a_drain_are_answered(setup: Setup) -> None:
    setup.batcher.update_policy(max_delay_s=0.2)
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: setup.batcher.num_pending == 1)
    stopping = asyncio.ensure_future(setup.batcher.stop(drain=True))
    await _until(lambda: bool(_items(transport)))
    np.testing.assert_array_equal(_binary_output(_items(transport)[0]), [[2, 2]])
    await stopping
    # After the drain the route goes to the ASGI path, which answers 503 (Closed).
    protocol.data_received(_binary_request(1.0))
    await _until(lambda: len(_items(transport)) == 2)
    assert _items(transport)[1][0] == 503


async def test_pipelined_request_dispatched_after_the_batcher_stopped_gets_503(
    setup: Setup,
) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0) + _binary_request(2.0))
    await _until(lambda: setup.model.running == 1)
    stopping = asyncio.ensure_future(setup.batcher.stop(drain=True))
    await asyncio.sleep(0.01)
    setup.model.open.set()
    await stopping
    await _until(lambda: len(_items(transport)) == 2)
    assert [s for s, _, _ in _items(transport)] == [200, 503]


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_access_log_names_the_request_s_http_version(
    version: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """With uvicorn's access log on, the fast path logs as uvicorn does, with the version
    the request was sent with."""
    s, repository = await _setup(access_log=True)
    try:
        protocol, transport = s.connect()
        logger = logging.getLogger("uvicorn.access")  # uvicorn's config stops propagation
        logger.addHandler(caplog.handler)
        try:
            with caplog.at_level("INFO", logger="uvicorn.access"):
                raw = _binary_request(1.0).replace(b"HTTP/1.1", b"HTTP/" + version, 1)
                protocol.data_received(raw)
                await _until(lambda: bool(_items(transport)))
        finally:
            logger.removeHandler(caplog.handler)
        lines = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
        assert lines == [f'- - "POST /v2/models/m/infer HTTP/{version.decode()}" 200']
    finally:
        await repository.stop()


# ---------------------------------------------------------------------------------------
# A refusal (400, 431) about the bytes after a request still being answered
# ---------------------------------------------------------------------------------------

GARBAGE = b"NOT-HTTP\r\n\r\n"
CHUNKED_BAD = (
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n"  # not a chunk size
)
ASGI_PATH = b"/v2/models/m/infer?via=asgi"
# A whole head of more than MAX_HEADER_FIELDS fields (431), and a target llhttp takes but
# uvicorn's own head checks refuse (400): both refused once the head is complete.
MANY_FIELDS = (
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\n"
    + b"".join(b"X-%d: v\r\n" % i for i in range(300))
    + b"Content-Length: 0\r\n\r\n"
)
BAD_TARGET = b"GET http://a:99999/x HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize(
    ("ahead", "bad", "statuses"),
    [
        (_binary_request(1.0), GARBAGE, [200, 400]),
        (_binary_request(1.0) + _binary_request(2.0), GARBAGE, [200, 200, 400]),
        (_binary_request(1.0, path=ASGI_PATH), GARBAGE, [200, 400]),
        (_binary_request(1.0) + LIVE, GARBAGE, [200, 200, 400]),
        (_binary_request(1.0), CHUNKED_BAD, [200, 400]),
        (_binary_request(1.0, path=ASGI_PATH), CHUNKED_BAD, [200, 400]),
        (_binary_request(1.0), b"POST /x HTTP/1.1\r\nA: " + b"a" * 70_000, [200, 431]),
        (_binary_request(1.0), MANY_FIELDS, [200, 431]),
        (_binary_request(1.0) + _binary_request(2.0), MANY_FIELDS, [200, 200, 431]),
        (_binary_request(1.0) + LIVE, MANY_FIELDS, [200, 200, 431]),
        (_binary_request(1.0), BAD_TARGET, [200, 400]),
        (_binary_request(1.0) + _binary_request(2.0), BAD_TARGET, [200, 200, 400]),
    ],
    ids=[
        "fast",
        "fast-pipelined",
        "asgi",
        "get-pipelined",
        "bad-chunk",
        "asgi-bad-chunk",
        "431",
        "fields",
        "fields-pipelined",
        "fields-get-pipelined",
        "target",
        "target-pipelined",
    ],
)
async def test_a_refusal_waits_for_the_answers_of_the_requests_before_it(
    setup: Setup, ahead: bytes, bad: bytes, statuses: list[int]
) -> None:
    """Was: a 400 or 431 about the bytes that follow a request still being answered was
    written at once and closed the connection: it came before the earlier answers, which
    were then lost. Answers go out in order (RFC 9112 9.3.2): the refusal waits for them,
    and only then is the connection closed; nothing read after the bad bytes is served."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(ahead)
    protocol.data_received(bad)  # one read: a head grows past the limit without progress
    protocol.data_received(_binary_request(7.0))  # after the bad bytes: never served
    assert not transport.closed and _items(transport) == []
    await _until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await _until(lambda: transport.closed)
    items = _items(transport)
    assert [status for status, _, _ in items] == statuses
    assert items[-1][1][b"connection"] == b"close"
    np.testing.assert_array_equal(_binary_output(items[0]), [[2, 2]])
    assert 7.0 not in setup.model.seen and transport.writes_after_close == 0


async def test_a_refusal_with_nothing_before_it_is_written_at_once(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(GARBAGE)
    assert transport.closed
    ((status, headers, _),) = _items(transport)
    assert status == 400 and headers[b"connection"] == b"close"


async def test_a_refusal_waiting_behind_an_answer_is_dropped_if_the_client_leaves(
    setup: Setup,
) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(_binary_request(1.0) + GARBAGE)
    await _until(lambda: setup.model.running == 1)
    protocol.connection_lost(None)
    transport.closed = True
    setup.model.open.set()
    await asyncio.sleep(0.05)
    assert transport.data == b"" and transport.writes_after_close == 0
