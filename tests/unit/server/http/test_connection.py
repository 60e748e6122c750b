"""One connection of carpool's HTTP/1.1 protocol (carpool.server.http.connection) held
to RFC 9112 and to the route handlers' answers: pipelined answers in order, keep-alive
and HTTP/1.0, 100-continue, back-pressure, a lost connection, shutdown, header and path
corner cases. Raw bytes are fed to a connection on a fake transport. The tests whose
docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import asyncio
import gzip
import socket
from contextlib import suppress
from typing import Any

import numpy as np
import pytest
import uvloop

from carpool import Batcher, BatchPolicy
from carpool.core.clock import settle
from carpool.server.app import KServeApp
from carpool.server.http.server import HttpServer
from carpool.server.limits import ServerLimits
from carpool.server.repository import ModelRepository, ServedModel

from .fakes import (
    BAD,
    LIVE,
    SPEC_IN,
    SPEC_OUT,
    Gate,
    Responses,
    Server,
    Setup,
    binary_output,
    binary_request,
    gated,
    items,
    json_request,
    until,
)


async def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(
        binary_request(1.0) + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
        + binary_request(5.0)
    )  # fmt: skip
    await until(lambda: len(Responses(bytes(transport.data)).items) == 3)
    first, live, last = Responses(bytes(transport.data)).items
    np.testing.assert_array_equal(binary_output(first), [[2, 2]])
    assert live[0] == 200
    np.testing.assert_array_equal(binary_output(last), [[10, 10]])


async def test_body_in_many_chunks_and_larger_than_a_high_water_mark(
    server: Server,
) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    raw = binary_request(0.5, rows=8000)  # 64 KB of tensor data, past 64 KiB in all
    for start in range(0, len(raw), 1000):
        protocol.data_received(raw[start : start + 1000])
    await until(lambda: bool(transport.data))
    output = binary_output(Responses(bytes(transport.data)).items[0])
    assert output.shape == (8000, 2) and np.all(output == 1.0)


async def test_a_gzip_body_that_inflates_past_the_limit_keeps_the_connection(
    server: Server,
) -> None:
    # Read in full, only too large once inflated: a 413, and the connection goes on.
    _, connect, _ = server
    protocol, transport = connect()
    raw = json_request(
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0.0] * 60_000}]},
        path=b"/v2/models/m/infer?a=1",
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    packed = gzip.compress(body)  # about 200 KB inflated, far less sent
    head = head.replace(b"Content-Length: %d" % len(body), b"Content-Length: %d" % len(packed))
    protocol.data_received(head + b"\r\nContent-Encoding: gzip\r\n\r\n" + packed)
    await until(lambda: bool(transport.data))
    ((status, headers, _),) = Responses(bytes(transport.data)).items
    assert status == 413 and headers.get(b"connection") != b"close"
    transport.data.clear()
    protocol.data_received(binary_request(2.0))
    await until(lambda: bool(transport.data))
    np.testing.assert_array_equal(
        binary_output(Responses(bytes(transport.data)).items[0]), [[4, 4]]
    )
    assert not transport.closed


async def test_connection_close_is_honoured(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0, extra=b"Connection: close\r\n"))
    await until(lambda: transport.closed)
    (response,) = Responses(bytes(transport.data)).items
    assert response[1][b"connection"] == b"close"
    np.testing.assert_array_equal(binary_output(response), [[2, 2]])


async def test_expect_100_continue_is_answered_before_the_body(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    raw = binary_request(1.0, extra=b"Expect: 100-continue\r\n")
    head, body = raw.split(b"\r\n\r\n", 1)
    protocol.data_received(head + b"\r\n\r\n")
    assert bytes(transport.data) == b"HTTP/1.1 100 Continue\r\n\r\n"
    protocol.data_received(body)
    await until(lambda: len(transport.data) > 25)
    (response,) = Responses(bytes(transport.data)[25:]).items
    np.testing.assert_array_equal(binary_output(response), [[2, 2]])


async def test_answer_heads_are_shared_until_the_default_headers_change(server: Server) -> None:
    """Answers of one shape share their status line and header fields; the server replaces
    its default headers (the date) every second, and the next answer carries the new."""
    _, connect, _ = server
    protocol, transport = connect()
    date = protocol._server.date
    date.headers = [(b"date", b"Mon, 01 Jan 2026 00:00:00 GMT")]
    for value in (1.0, 2.0):
        protocol.data_received(binary_request(value))
        await until(lambda: len(Responses(bytes(transport.data)).items) == int(value))  # noqa: B023
    date.headers = [(b"date", b"Mon, 01 Jan 2026 00:00:01 GMT"), (b"server", b"x")]
    protocol.data_received(binary_request(3.0))
    protocol.data_received(binary_request(4.0, extra=b"Connection: close\r\n"))
    await until(lambda: len(Responses(bytes(transport.data)).items) == 4)
    answers = Responses(bytes(transport.data)).items
    assert [item[1][b"date"] for item in answers] == [
        b"Mon, 01 Jan 2026 00:00:00 GMT",
        b"Mon, 01 Jan 2026 00:00:00 GMT",
        b"Mon, 01 Jan 2026 00:00:01 GMT",
        b"Mon, 01 Jan 2026 00:00:01 GMT",
    ]
    assert b"server" not in answers[1][1] and answers[2][1][b"server"] == b"x"
    assert b"connection" not in answers[2][1] and answers[3][1][b"connection"] == b"close"
    assert [binary_output(item)[0, 0] for item in answers] == [2.0, 4.0, 6.0, 8.0]
    assert transport.closed


async def test_many_pipelined_bad_requests_are_all_answered(setup: Setup) -> None:
    """Was: requests pipelined behind one in flight and answered on the spot (decode
    errors, QueueFull, Closed) began each other recursively (_answer ->
    on_response_complete -> _begin -> _dispatch -> _answer); a few
    hundred hit the recursion limit and the rest were never answered. Each now begins on
    the next loop turn."""
    setup.model.open.clear()
    protocol, transport = setup.connect()
    n = 400
    protocol.data_received(binary_request(1.0) + BAD * n)
    await until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await until(lambda: len(items(transport)) == n + 1, timeout_s=3.0)


@pytest.mark.parametrize("path", [b"/v2/models/m/infer?via=handler", b"/v2/models/m/infer"])
async def test_no_answers_are_written_while_the_client_does_not_read(
    setup: Setup, path: bytes
) -> None:
    """With the transport's write side paused (the client is not reading), nothing more is
    written and the next request is not started, on the fast path and a handler's alike.
    Was: the fast path wrote regardless and resumed reading after every answer, so a client
    that never read made the server buffer answers without bound. It now holds the answer
    until resume_writing."""
    protocol, transport = setup.connect()
    protocol.pause_writing()
    protocol.data_received(binary_request(0.0, path=path))
    await until(lambda: setup.model.seen == [0.0])  # answered by the model, not written
    for i in (1, 2):
        protocol.data_received(binary_request(float(i), path=path))
    await settle()
    assert len(items(transport)) == 0
    assert setup.batcher.num_pending == 0 and setup.model.seen == [0.0]  # none started
    protocol.resume_writing()
    await until(lambda: len(items(transport)) >= 1)


async def test_duplicate_inference_header_length_is_read_as_by_the_handler(
    setup: Setup,
) -> None:
    """With two Inference-Header-Content-Length headers both paths read the first. Was: the
    fast path read the last, so the same bytes got different answers depending on whether
    the URL carried a query (a query takes the route's handler)."""
    good = binary_request(1.0)
    head, body = good.split(b"\r\n\r\n", 1)
    raw_head = head + b"\r\nInference-Header-Content-Length: 7\r\n\r\n"
    answers = {}
    for name, path in {"handler": b"/v2/models/m/infer?q=1", "fast": b"/v2/models/m/infer"}.items():
        protocol, transport = setup.connect()
        protocol.data_received(raw_head.replace(b"/v2/models/m/infer", path, 1) + body)
        await until(lambda t=transport: bool(items(t)))
        answers[name] = items(transport)[0][0]
    assert answers["fast"] == answers["handler"]


async def test_empty_version_segment_is_routed_as_by_the_handler(setup: Setup) -> None:
    """``/v2/models/m/versions//infer`` is a 404 on both paths. Was: the fast path passed
    version "" to repository.get, which read it as "any version" and answered 200."""
    answers = {}
    for name, path in {
        "handler": b"/v2/models/m/versions//infer?q=1",
        "fast": b"/v2/models/m/versions//infer",
    }.items():
        protocol, transport = setup.connect()
        protocol.data_received(binary_request(1.0, path=path))
        await until(lambda t=transport: bool(items(t)))
        answers[name] = items(transport)[0][0]
    assert answers == {"handler": 404, "fast": 404}


# ---------------------------------------------------------------------------------------
# Checked and correct (these pass)
# ---------------------------------------------------------------------------------------


async def test_request_fed_one_byte_at_a_time(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = binary_request(2.5, extra=b"iNfErEnCe-HeAdEr-CoNtEnT-LeNgTh-X: 1\r\n")
    for i in range(len(raw)):
        protocol.data_received(raw[i : i + 1])
    await until(lambda: bool(items(transport)))
    np.testing.assert_array_equal(binary_output(items(transport)[0]), [[5, 5]])


async def test_lower_case_header_name(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = binary_request(1.0).replace(
        b"Inference-Header-Content-Length", b"inference-header-content-length"
    )
    protocol.data_received(raw)
    await until(lambda: bool(items(transport)))
    np.testing.assert_array_equal(binary_output(items(transport)[0]), [[2, 2]])


async def test_chunked_body(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = binary_request(1.5)
    head, body = raw.split(b"\r\n\r\n", 1)
    head = head.replace(b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked")
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7])
                       for i in range(0, len(body), 7)) + b"0\r\n\r\n"  # fmt: skip
    protocol.data_received(head + b"\r\n\r\n" + chunked + LIVE)
    await until(lambda: len(items(transport)) == 2)
    first, live = items(transport)
    np.testing.assert_array_equal(binary_output(first), [[3, 3]])
    assert live[0] == 200


async def test_empty_body_gets_400_and_keeps_the_connection(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\n\r\n" + LIVE
    )
    await until(lambda: len(items(transport)) == 3)
    assert [s for s, _, _ in items(transport)] == [400, 400, 200]
    assert not transport.closed


async def test_http10_without_and_with_keep_alive_closes(setup: Setup) -> None:
    for extra in (b"", b"Connection: keep-alive\r\n"):
        protocol, transport = setup.connect()
        raw = binary_request(1.0, extra=extra).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        protocol.data_received(raw)
        await until(lambda t=transport: t.closed)
        (response,) = items(transport)
        assert response[1][b"connection"] == b"close"
        np.testing.assert_array_equal(binary_output(response), [[2, 2]])


@pytest.mark.parametrize("version", [b"2.0", b"3.0", b"1.2"])
async def test_a_request_line_of_another_version_gets_505(setup: Setup, version: bytes) -> None:
    """RFC 9110 15.6.6. Was: an ``HTTP/2.0`` request line answered 200, as HTTP/1.1, and
    ``HTTP/3.0`` or ``HTTP/1.2`` a 400 (llhttp refuses them before the head is done)."""
    protocol, transport = setup.connect()
    protocol.data_received(LIVE.replace(b"HTTP/1.1", b"HTTP/" + version, 1))
    await until(lambda: len(items(transport)) == 1)
    ((status, _, body),) = items(transport)
    assert status == 505 and b"HTTP/1.1" in body


@pytest.mark.parametrize(
    ("value", "status"),
    [(b"a, b", 400), (b"a b", 400), (b"http://a/", 400), (b"x:80:90", 400)]
    + [(v, 200) for v in (b"", b"127.0.0.1:8000", b"[::1]:80", b"example.com:", b"a,b")],
)
async def test_a_host_value_is_a_host_and_an_optional_port(
    setup: Setup, value: bytes, status: int
) -> None:
    """RFC 9112 3.2: a Host field with an invalid value is a 400. Was: 200."""
    protocol, transport = setup.connect()
    protocol.data_received(LIVE.replace(b"Host: t", b"Host: " + value, 1))
    await until(lambda: len(items(transport)) == 1)
    ((answered, _, body),) = items(transport)
    assert answered == status
    if status == 400:
        assert b"is not a host and an optional port" in body


@pytest.mark.parametrize(
    ("version", "hosts", "status"),
    [
        (b"1.1", b"Host: t\r\nHost: u\r\n", 400),
        (b"1.1", b"", 400),
        (b"1.0", b"Host: t\r\nHost: u\r\n", 400),
        (b"1.0", b"", 200),
    ],
)
async def test_an_http11_request_has_one_host_field_and_an_http10_one_at_most(
    setup: Setup, version: bytes, hosts: bytes, status: int
) -> None:
    """RFC 9112 3.2: a 400 to an HTTP/1.1 request without a Host field, and to any request
    with more than one. Was: 200 for either."""
    protocol, transport = setup.connect()
    raw = b"GET /v2/health/live HTTP/" + version + b"\r\n" + hosts + b"\r\n"
    protocol.data_received(raw)
    await until(lambda: len(items(transport)) == 1)
    ((answered, _, body),) = items(transport)
    assert answered == status
    if status == 400:
        assert b"Host header fields; an HTTP/" + version + b" request has one" in body


async def test_request_after_connection_close_is_ignored(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(
        binary_request(1.0, extra=b"Connection: close\r\n") + binary_request(8.0)
    )
    await until(lambda: transport.closed)
    await settle()
    assert len(items(transport)) == 1
    assert setup.batcher.num_pending == 0 and setup.model.running == 0  # nothing left to run
    assert 8.0 not in setup.model.seen


async def test_pipelined_after_a_400_and_mixed_paths_keep_order(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(
        LIVE + binary_request(1.0) + BAD + binary_request(2.0, path=b"/v2/models/m/infer?a=1")
        + binary_request(3.0) + LIVE
    )  # fmt: skip
    await until(lambda: setup.model.running == 1)  # the first infer is held in the model
    setup.model.open.set()
    await until(lambda: len(items(transport)) == 6)
    statuses = [s for s, _, _ in items(transport)]
    assert statuses == [200, 200, 400, 200, 200, 200]
    outputs = [binary_output(r)[0, 0] for r in items(transport)[1:5] if r[0] == 200]
    assert outputs == [2, 4, 6]


async def _expecting_behind_a_running_request(s: Setup) -> tuple[Any, Any, bytes]:
    """A request held running, a second pipelined behind it with ``Expect: 100-continue``
    and only its head sent: the connection, its transport and the second's body."""
    s.model.open.clear()
    protocol, transport = s.connect()
    second = binary_request(4.0, extra=b"Expect: 100-continue\r\n")
    head, body = second.split(b"\r\n\r\n", 1)
    protocol.data_received(binary_request(1.0) + head + b"\r\n\r\n")
    await until(lambda: s.model.running == 1)
    return protocol, transport, body


async def test_expect_continue_pipelined_behind_a_running_request(setup: Setup) -> None:
    protocol, transport, body = await _expecting_behind_a_running_request(setup)
    assert b"100 Continue" not in transport.data  # not before the first answer
    assert transport.reading  # read ahead (READ_AHEAD_*): a hang-up is still seen
    setup.model.open.set()
    await until(lambda: b"100 Continue" in transport.data)
    first_end = transport.data.index(b"HTTP/1.1 100 Continue")
    assert len(Responses(bytes(transport.data[:first_end])).items) == 1
    assert transport.reading
    protocol.data_received(body)
    await until(lambda: len(Responses(bytes(transport.data[first_end + 25 :])).items) == 1)
    (response,) = Responses(bytes(transport.data[first_end + 25 :])).items
    np.testing.assert_array_equal(binary_output(response), [[8, 8]])


async def test_a_continued_body_has_its_whole_body_time_from_the_100() -> None:
    """Was: the body's deadline ran from its head, so a request pipelined behind one that
    ran past --body-timeout-s got "100 Continue" and then at once a 408."""
    s, repository = await gated(limits=ServerLimits(body_timeout_s=0.2))
    try:
        protocol, transport, body = await _expecting_behind_a_running_request(s)
        await asyncio.sleep(0.3)  # the first runs past the second's body time
        s.model.open.set()
        await until(lambda: b"100 Continue" in transport.data)
        await asyncio.sleep(0.05)  # within the body time counted from the 100
        protocol.data_received(body)
        first_end = transport.data.index(b"HTTP/1.1 100 Continue") + 25
        await until(lambda: len(Responses(bytes(transport.data[first_end:])).items) == 1)
        (response,) = Responses(bytes(transport.data[first_end:])).items
        assert response[0] == 200, response
    finally:
        s.model.open.set()
        await repository.stop()


async def test_an_http10_request_expecting_100_gets_no_1xx(server: Server) -> None:
    """RFC 9110 10.1.1: the expectation of an HTTP/1.0 request is ignored, and no 1xx goes
    to an HTTP/1.0 client. Was: "100 Continue" written."""
    _, connect, _ = server
    protocol, transport = connect()
    raw = binary_request(1.0, extra=b"Expect: 100-continue\r\n").replace(b"HTTP/1.1", b"HTTP/1.0")
    head, body = raw.split(b"\r\n\r\n", 1)
    protocol.data_received(head + b"\r\n\r\n")
    await asyncio.sleep(0.01)
    assert b"100 Continue" not in transport.data
    protocol.data_received(body)
    await until(lambda: len(Responses(bytes(transport.data)).items) == 1)
    (response,) = Responses(bytes(transport.data)).items
    np.testing.assert_array_equal(binary_output(response), [[2, 2]])


async def test_pipelined_requests_are_judged_by_the_queue_at_their_turn(setup: Setup) -> None:
    """Was: with a queue bound of 1, four requests in one write got 200 and three 429s,
    the queue being full of the first one when their heads were read; each reaches the
    queue only once the one before it is answered."""
    setup.batcher.update_policy(max_queue_size=1)
    protocol, transport = setup.connect()
    protocol.data_received(b"".join(binary_request(float(v)) for v in (1, 2, 3, 4)))
    await until(lambda: len(items(transport)) == 4)
    assert [status for status, _, _ in items(transport)] == [200] * 4
    outputs = [float(binary_output(r)[0, 0]) for r in items(transport)]
    assert outputs == [2.0, 4.0, 6.0, 8.0]


async def test_connection_lost_while_the_model_runs(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0))
    await until(lambda: setup.model.running == 1)
    protocol.connection_lost(None)
    setup.model.open.set()
    await until(lambda: setup.model.running == 0)  # the model has answered, for nobody
    await settle()
    assert transport.data == b"" and transport.writes_after_close == 0


async def test_connection_lost_cancels_the_handler_running_ahead_of_a_pipelined_one(
    setup: Setup,
) -> None:
    """Was: uvicorn marked only the newest (pipelined) cycle disconnected; the running ASGI
    request kept its queued request, then wrote to the closed transport (uvloop raises).
    The handler running now is cancelled, and its queued request withdrawn."""
    setup.batcher.update_policy(max_delay_s=60.0)  # queued until withdrawn
    protocol, transport = setup.connect()
    handled = binary_request(1.0, path=b"/v2/models/m/infer?via=handler")
    protocol.data_received(handled + handled)
    await until(lambda: setup.batcher.num_pending == 1)
    protocol.connection_lost(None)
    await until(lambda: not setup.server.tasks)  # the handler's task is over
    rejections = setup.batcher.snapshot().classes["normal"].rejections
    assert rejections == {"cancelled": 1} and setup.batcher.num_pending == 0  # withdrawn
    assert setup.model.seen == [] and transport.data == b""
    assert transport.writes_after_close == 0


async def test_connection_lost_with_a_pipelined_request_waiting(setup: Setup) -> None:
    setup.batcher.update_policy(max_delay_s=60.0)  # queued until withdrawn
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0) + binary_request(2.0))
    await until(lambda: setup.batcher.num_pending == 1)
    protocol.connection_lost(None)
    await settle()
    rejections = setup.batcher.snapshot().classes["normal"].rejections
    assert rejections == {"cancelled": 1} and setup.batcher.num_pending == 0  # withdrawn
    assert setup.model.seen == [] and transport.data == b""


async def test_shutdown_with_a_request_in_flight_answers_it_then_closes(setup: Setup) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0))
    await until(lambda: setup.model.running == 1)
    protocol.shutdown()
    assert not transport.closed
    setup.model.open.set()
    await until(lambda: transport.closed)
    (response,) = items(transport)
    assert response[1][b"connection"] == b"close"
    np.testing.assert_array_equal(binary_output(response), [[2, 2]])


async def test_requests_queued_before_a_drain_are_answered(setup: Setup) -> None:
    setup.batcher.update_policy(max_delay_s=0.2)
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0))
    await until(lambda: setup.batcher.num_pending == 1)
    stopping = asyncio.ensure_future(setup.batcher.stop(drain=True))
    await until(lambda: bool(items(transport)))
    np.testing.assert_array_equal(binary_output(items(transport)[0]), [[2, 2]])
    await stopping
    # After the drain the route goes to its handler, which answers 503 (Closed).
    protocol.data_received(binary_request(1.0))
    await until(lambda: len(items(transport)) == 2)
    assert items(transport)[1][0] == 503


async def test_pipelined_request_dispatched_after_the_batcher_stopped_gets_503(
    setup: Setup,
) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0) + binary_request(2.0))
    await until(lambda: setup.model.running == 1)
    stopping = asyncio.ensure_future(setup.batcher.stop(drain=True))
    await settle()  # the batcher stops taking requests, draining the one it runs
    setup.model.open.set()
    await stopping
    await until(lambda: len(items(transport)) == 2)
    assert [s for s, _, _ in items(transport)] == [200, 503]


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_access_log_names_the_request_s_http_version(
    version: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """With the access log on, an answer is logged with the version the request was sent
    with."""
    s, repository = await gated(access_log=True)
    try:
        protocol, transport = s.connect()
        with caplog.at_level("INFO", logger="carpool.server.access"):
            raw = binary_request(1.0).replace(b"HTTP/1.1", b"HTTP/" + version, 1)
            protocol.data_received(raw)
            await until(lambda: bool(items(transport)))
        lines = [r.getMessage() for r in caplog.records if r.name == "carpool.server.access"]
        assert lines == [f'- - "POST /v2/models/m/infer HTTP/{version.decode()}" 200']
    finally:
        await repository.stop()


def test_a_connection_refused_on_its_first_read_is_not_read_while_it_waits() -> None:
    """Was: uvloop starts reading once connection_made returns, also when the protocol
    paused inside it; a connection whose first request went to the waiting room then had
    each retry read and refused while it waited. Real sockets, on uvloop as served."""

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        gate = Gate()
        gate.open.clear()
        policy = BatchPolicy(max_batch_size=1, max_delay_s=0.0, max_queue_size=1)
        batcher = Batcher(gate, policy, collate="dict")
        model = ServedModel("m", "1", "python", (SPEC_IN,), (SPEC_OUT,), batcher)
        repository = ModelRepository([model])
        await repository.start()
        server = HttpServer(KServeApp(repository, max_body_bytes=100_000))
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        server.start([listener])
        clients = []
        try:
            for value in (1.0, 2.0):  # one runs (held), one waits: the queue is full
                client = socket.create_connection(server.addresses[0])
                client.setblocking(False)
                await loop.sock_sendall(client, binary_request(value))
                clients.append(client)
                await until(lambda: gate.running == 1)
                await settle()
            refused = socket.create_connection(server.addresses[0])
            refused.setblocking(False)
            clients.append(refused)
            await loop.sock_sendall(refused, binary_request(3.0))  # read as it is accepted
            statuses = [Responses(await loop.sock_recv(refused, 65536)).items[0][0]]
            await loop.sock_sendall(refused, binary_request(4.0))  # its retry at once
            with suppress(TimeoutError):  # not read until the model has room
                async with asyncio.timeout(0.3):
                    statuses.append(Responses(await loop.sock_recv(refused, 65536)).items[0][0])
            gate.open.set()  # room: the retry is read and served
            async with asyncio.timeout(5):
                while len(statuses) < 2:
                    statuses += [
                        s for s, _, _ in Responses(await loop.sock_recv(refused, 65536)).items
                    ]
            return statuses
        finally:
            gate.open.set()
            for client in clients:
                client.close()
            server.cut()
            server.close()
            await repository.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == [429, 200]
