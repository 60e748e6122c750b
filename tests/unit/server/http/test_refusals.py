"""Refusals (carpool.server.http.refusals): bytes that cannot be a request, a body past
the limit, and what comes after them. Answers go out in order (RFC 9112 9.3.2): a refusal
waits for the answers of the requests before it, then the connection closes; nothing read
after the bad bytes is served. The tests whose docstrings start "Was:" failed before the
fixes they name."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from carpool.core.clock import settle

from .fakes import (
    BAD,
    LIVE,
    Responses,
    Server,
    Setup,
    binary_output,
    binary_request,
    items,
    until,
)


@pytest.mark.parametrize(
    "path",
    [b"/v2/models/m/infer", b"/v2/models/m/infer?x=1"],  # the fast path, then the handler
)
async def test_body_over_the_limit_gets_413_and_the_connection_closes(
    server: Server, path: bytes
) -> None:
    # Was: uvicorn's ASGI path kept the connection and read the rest of the body on (a
    # 64 MiB limit let a client make it read any amount); both paths now close.
    _, connect, model = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0, rows=20_000, path=path))  # 160 KB > 100 KB
    await until(lambda: transport.closed)
    ((status, headers, body),) = Responses(bytes(transport.data)).items
    assert status == 413 and headers[b"connection"] == b"close"
    assert "100000" in orjson.loads(body)["error"]
    assert transport.closed
    assert model.seen == []


async def test_pipelined_oversized_request_is_answered_after_the_request_before_it(
    setup: Setup,
) -> None:
    """Was: a 413 for a request pipelined behind one still being answered was written at
    once (before the earlier answer) and closed the connection, losing the earlier answer.
    Pipelined requests are answered strictly in order (RFC 9112 9.3.2): the 413 waits for
    its turn."""
    setup.model.open.clear()  # the first request stays in the model
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0) + binary_request(1.0, rows=20_000))
    await until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await until(lambda: transport.closed)  # the 413 closes the connection once written
    statuses = [status for status, _, _ in items(transport)]
    assert statuses == [200, 413]


async def test_data_after_a_413_is_not_served(setup: Setup) -> None:
    """Nothing after a response with connection: close is processed (RFC 9112 9.6). Was:
    the parser went on with the rest of the same read after a 413; the next request got
    its 400 written onto the closed transport, the one after it its 100 Continue, and it
    was queued in the batcher."""
    protocol, transport = setup.connect()
    protocol.data_received(
        binary_request(1.0, rows=20_000) + BAD
        + binary_request(9.0, extra=b"Expect: 100-continue\r\n")
    )  # fmt: skip
    written_after_close, queued = transport.writes_after_close, setup.batcher.num_pending
    protocol.connection_lost(None)  # what the loop does after transport.close()
    assert [status for status, _, _ in items(transport)] == [413]
    assert (written_after_close, queued) == (0, 0)


async def test_chunked_and_content_length_is_rejected_with_400(setup: Setup) -> None:
    protocol, transport = setup.connect()
    raw = binary_request(1.5, extra=b"Transfer-Encoding: chunked\r\n")
    protocol.data_received(raw)
    await settle()
    (response,) = items(transport)
    assert response[0] == 400 and transport.closed
    assert setup.batcher.num_pending == 0 and setup.model.seen == []  # never queued


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"x-custom, chunked"])
async def test_a_transfer_coding_besides_chunked_is_refused_with_501(
    setup: Setup, coding: bytes
) -> None:
    """RFC 9112 6.1: a coding the server cannot decode is a 501; was: read as plain
    chunked, so a gzipped body reached the JSON decoder (a 400 about UTF-8)."""
    protocol, transport = setup.connect()
    protocol.data_received(
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: "
        + coding
        + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    await settle()
    (response,) = items(transport)
    assert response[0] == 501 and transport.closed
    assert b"Transfer-Encoding" in response[2] and coding in response[2]
    assert setup.batcher.num_pending == 0 and setup.model.seen == []


# ---------------------------------------------------------------------------------------
# A refusal (400, 431) about the bytes after a request still being answered
# ---------------------------------------------------------------------------------------

GARBAGE = b"NOT-HTTP\r\n\r\n"
CHUNKED_BAD = (
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\n"  # not a chunk size
)
HANDLER_PATH = b"/v2/models/m/infer?via=handler"
# A whole head of more than MAX_HEADER_FIELDS fields (431), and a target llhttp takes but
# that is no URL path (400): both refused once the head is complete.
MANY_FIELDS = (
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\n"
    + b"".join(b"X-%d: v\r\n" % i for i in range(300))
    + b"Content-Length: 0\r\n\r\n"
)
BAD_TARGET = b"GET http://a:99999/x HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize(
    ("ahead", "bad", "statuses"),
    [
        (binary_request(1.0), GARBAGE, [200, 400]),
        (binary_request(1.0) + binary_request(2.0), GARBAGE, [200, 200, 400]),
        (binary_request(1.0, path=HANDLER_PATH), GARBAGE, [200, 400]),
        (binary_request(1.0) + LIVE, GARBAGE, [200, 200, 400]),
        (binary_request(1.0), CHUNKED_BAD, [200, 400]),
        (binary_request(1.0, path=HANDLER_PATH), CHUNKED_BAD, [200, 400]),
        (binary_request(1.0), b"POST /x HTTP/1.1\r\nA: " + b"a" * 70_000, [200, 431]),
        (binary_request(1.0), MANY_FIELDS, [200, 431]),
        (binary_request(1.0) + binary_request(2.0), MANY_FIELDS, [200, 200, 431]),
        (binary_request(1.0) + LIVE, MANY_FIELDS, [200, 200, 431]),
        (binary_request(1.0), BAD_TARGET, [200, 400]),
        (binary_request(1.0) + binary_request(2.0), BAD_TARGET, [200, 200, 400]),
    ],
    ids=[
        "fast",
        "fast-pipelined",
        "handler",
        "get-pipelined",
        "bad-chunk",
        "handler-bad-chunk",
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
    protocol.data_received(binary_request(7.0))  # after the bad bytes: never served
    assert not transport.closed and items(transport) == []
    await until(lambda: setup.model.running == 1)
    setup.model.open.set()
    await until(lambda: transport.closed)
    answers = items(transport)
    assert [status for status, _, _ in answers] == statuses
    assert answers[-1][1][b"connection"] == b"close"
    np.testing.assert_array_equal(binary_output(answers[0]), [[2, 2]])
    assert 7.0 not in setup.model.seen and transport.writes_after_close == 0


async def test_a_refusal_with_nothing_before_it_is_written_at_once(setup: Setup) -> None:
    protocol, transport = setup.connect()
    protocol.data_received(GARBAGE)
    assert transport.closed
    ((status, headers, _),) = items(transport)
    assert status == 400 and headers[b"connection"] == b"close"


async def test_a_refusal_waiting_behind_an_answer_is_dropped_if_the_client_leaves(
    setup: Setup,
) -> None:
    setup.model.open.clear()
    protocol, transport = setup.connect()
    protocol.data_received(binary_request(1.0) + GARBAGE)
    await until(lambda: setup.model.running == 1)
    protocol.connection_lost(None)
    transport.closed = True
    setup.model.open.set()
    await until(lambda: setup.model.running == 0)  # the model has answered, for nobody
    await settle()
    assert transport.data == b"" and transport.writes_after_close == 0
