"""Repeated heads (carpool.server.http.repeats): which request heads are kept, and a
request whose bytes start with the head of the connection's last fast-path request is
taken without the parser. Each test holds the answers to what the parser's path gives,
and checks when the parser is, and is not, skipped."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson
import pytest

from carpool import Batcher
from carpool.server.http.connection import Connection
from carpool.server.http.guards import MAX_HEAD_BYTES
from carpool.server.http.repeats import MAX_REPEATED_HEAD_BYTES, repeated_head
from carpool.server.infer import InferPlans, infer_response, prepare_infer
from carpool.server.kserve.rest_encode import encode_infer_response
from carpool.server.kserve.tensors import OutputTensor
from carpool.server.repository import ServedModel, TensorSpec

from .fakes import (
    LIVE,
    FakeTransport,
    Responses,
    Server,
    binary_output,
    binary_request,
    json_request,
    until,
)

# -- which heads are kept --------------------------------------------------------------

URL = b"/v2/models/m/infer"
BODY = b'{"inputs":[]}'
HEAD = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (URL, len(BODY))
HEADERS = [(b"host", b"t"), (b"content-length", b"%d" % len(BODY))]


def _kept(chunk: bytes, headers: list[tuple[bytes, bytes]] = HEADERS, body: bytes = BODY) -> bool:
    return repeated_head(chunk, URL, headers, body, None, None, "1.1") is not None


def test_a_plain_request_is_kept_with_what_it_parsed_to() -> None:
    repeat = repeated_head(HEAD + BODY + b"POST", URL, HEADERS, BODY, b"12", b"gzip", "1.1")
    assert repeat is not None
    assert (repeat.head, repeat.size, repeat.url) == (HEAD, len(BODY), URL)
    assert (repeat.header_length, repeat.encoding, repeat.http_version) == (b"12", b"gzip", "1.1")


@pytest.mark.parametrize(
    ("chunk", "headers", "body"),
    [
        pytest.param(HEAD + BODY[:-1], HEADERS, BODY, id="the body not whole in the read"),
        pytest.param(HEAD + b"x" + BODY, HEADERS, BODY, id="the body not right after the head"),
        pytest.param(
            HEAD + BODY, [*HEADERS, (b"transfer-encoding", b"chunked")], BODY, id="chunked"
        ),
        pytest.param(
            HEAD + BODY, [*HEADERS, (b"content-length", b"13")], BODY, id="two content-lengths"
        ),
        pytest.param(HEAD + BODY, [(b"host", b"t")], BODY, id="no content-length"),
        pytest.param(b"\r\n" + HEAD + BODY, HEADERS, BODY, id="a blank line first"),
        pytest.param(HEAD.replace(b"POST", b"PUT", 1) + BODY, HEADERS, BODY, id="another line"),
        pytest.param(
            HEAD.replace(b"Host: t\r\n", b"Host: t\n") + BODY, HEADERS, BODY, id="a bare LF"
        ),
        pytest.param(b"\r\n\r\n" + HEAD, HEADERS, b"", id="an empty head"),
    ],
)
def test_heads_whose_parse_is_not_all_in_their_bytes_are_not_kept(
    chunk: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    if body == b"":
        headers = [(b"content-length", b"0")]
    assert not _kept(chunk, headers, body)


def test_heads_over_the_limit_are_not_kept() -> None:
    padding = b"x" * MAX_REPEATED_HEAD_BYTES
    head = HEAD.replace(b"Host: t", b"Host: " + padding)
    headers = [(b"host", padding), HEADERS[1]]
    assert not _kept(head + BODY, headers)


# -- taken without the parser ----------------------------------------------------------


class CountingParser:
    """The protocol's parser, counting the reads fed to it."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.feeds = 0

    def feed_data(self, data: bytes) -> None:
        self.feeds += 1
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def _counted(protocol: Connection) -> CountingParser:
    counting = CountingParser(protocol._parser)
    protocol._parser = counting  # type: ignore[assignment]
    return counting


async def _answers(transport: FakeTransport, count: int) -> list[Any]:
    await until(lambda: len(Responses(bytes(transport.data)).items) >= count)
    items = Responses(bytes(transport.data)).items
    assert len(items) == count
    return items


async def test_a_repeated_head_skips_the_parser_and_each_body_is_its_own(server: Server) -> None:
    _, connect, model = server
    protocol, transport = connect()
    parser = _counted(protocol)
    for i in range(4):
        protocol.data_received(binary_request(float(i)))
        await _answers(transport, i + 1)
    items = Responses(bytes(transport.data)).items
    for i, item in enumerate(items):
        np.testing.assert_array_equal(binary_output(item), [[2.0 * i, 2.0 * i]])
    assert parser.feeds == 1  # the first request's head was parsed, then kept
    assert model.seen == [0.0, 1.0, 2.0, 3.0]


async def test_json_requests_repeat_too(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    parser = _counted(protocol)
    for value in (1.0, 2.0):  # the same length of document: the same head
        tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
        protocol.data_received(json_request({"inputs": [tensor]}))
    items = await _answers(transport, 2)
    assert [item[2].count(b"[2.0,2.0]") + item[2].count(b"[4.0,4.0]") for item in items] == [1, 1]
    assert b"[2.0,2.0]" in items[0][2] and b"[4.0,4.0]" in items[1][2]
    assert parser.feeds == 1


async def test_pipelined_repeats_in_one_read_are_answered_in_order(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0))
    await _answers(transport, 1)
    parser = _counted(protocol)
    protocol.data_received(b"".join(binary_request(float(v)) for v in (2, 3, 4)) + LIVE)
    items = await _answers(transport, 5)
    assert [binary_output(item)[0, 0] for item in items[:4]] == [2.0, 4.0, 6.0, 8.0]
    assert items[4][0] == 200
    assert parser.feeds == 1  # the three repeats taken, the GET left to the parser


async def test_a_repeat_cut_short_by_the_read_goes_to_the_parser(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0))
    await _answers(transport, 1)
    raw = binary_request(5.0)
    for cut in (len(raw) - 1, 10):  # the head whole but not the body; the head cut
        protocol.data_received(raw[:cut])
        protocol.data_received(raw[cut:])
    items = await _answers(transport, 3)
    assert [binary_output(item)[0, 0] for item in items] == [2.0, 10.0, 10.0]


async def test_a_head_kept_before_another_route_is_still_answered_right(server: Server) -> None:
    """The parser's last message is then a GET: what the repeat takes is its own."""
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0))
    protocol.data_received(LIVE)
    protocol.data_received(binary_request(2.0))
    items = await _answers(transport, 3)
    assert items[1][0] == 200
    assert binary_output(items[2])[0, 0] == 4.0


async def test_a_stopped_model_is_answered_as_the_parsers_path_answers_it(
    server: Server,
) -> None:
    app, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(binary_request(1.0))
    await _answers(transport, 1)
    await app.repository.get("m", None).batcher.stop()
    protocol.data_received(binary_request(2.0))
    fresh, fresh_transport = connect()
    fresh.data_received(binary_request(2.0))
    repeat, alone = (await _answers(transport, 2))[1], (await _answers(fresh_transport, 1))[0]
    assert repeat[0] == alone[0] == 503
    assert repeat[2] == alone[2]


async def test_heads_whose_parse_needs_the_parser_are_not_kept(server: Server) -> None:
    _, connect, _ = server
    raw = binary_request(1.0)
    chunked_head, body = raw.split(b"\r\n\r\n", 1)
    chunked_head = chunked_head.replace(b"Content-Length", b"Transfer-Encoding: chunked\r\nX-Len")
    chunked = chunked_head + b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    heads = {
        "connection close": binary_request(1.0, extra=b"Connection: close\r\n"),
        "expect": binary_request(1.0, extra=b"Expect: 100-continue\r\n"),
        "http/1.0": raw.replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        "chunked": chunked,
        "bare LF": raw.replace(b"Host: t\r\n", b"Host: t\n", 1),  # refused (400) as well
        "a blank line first": b"\r\n" + raw,
        "a whole message split": raw[:-1],  # the body's last byte comes in the next read
    }
    for name, request in heads.items():
        protocol, transport = connect()
        protocol.data_received(request)
        if name == "a whole message split":
            protocol.data_received(raw[-1:])
        await _answers(transport, 1)
        assert protocol._repeat is None, name
    protocol, transport = connect()
    protocol.data_received(raw)
    await _answers(transport, 1)
    assert protocol._repeat is not None


async def test_the_first_of_several_requests_in_a_read_is_kept(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    first, second = binary_request(1.0), binary_request(1.0, rows=2)
    protocol.data_received(first + second)
    await _answers(transport, 2)
    repeat = protocol._repeat
    assert repeat is not None and first.startswith(repeat.head)
    assert repeat.size == len(first) - len(repeat.head)


# -- found by review: the same bytes, cut into the same reads, get what the parser's path
# gives them; JSON answer cuts as the full encoder writes them


def _statuses(transport: FakeTransport) -> list[int]:
    """The status of each answer written, read leniently (an answer may follow one that
    closed the connection)."""
    return [int(status) for status in re.findall(rb"HTTP/1.1 (\d{3}) ", bytes(transport.data))]


async def test_a_head_after_repeats_counts_its_bytes_as_after_a_parsed_message(
    server: Server,
) -> None:
    """Was: a read of whole repeats then part of another head left the parser no progress
    to see, so that part counted towards MAX_HEAD_BYTES; fed to the parser, the message
    before it was progress and it did not count. A head arriving over three reads was then
    refused (431) after a repeat, and taken after the same bytes parsed. The head is over
    MAX_HEAD_BYTES in all (1.25x), so both paths now refuse it once it is complete: the
    same answer either way, as a head in one read gets (issue 22, 9)."""
    _, connect, _ = server
    half = MAX_HEAD_BYTES * 5 // 8
    get = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\n\r\n" % (b"a" * 2 * half)
    reads = [binary_request(2.0) + get[:half], get[half : 2 * half], get[2 * half :]]
    statuses = []
    for is_kept in (False, True):
        protocol, transport = connect()
        protocol.data_received(binary_request(1.0))
        await _answers(transport, 1)
        assert protocol._repeat is not None
        if not is_kept:
            protocol._repeat = None  # the parser's path
        for read in reads:
            protocol.data_received(read)
        await until(lambda: transport.closed)  # noqa: B023 - the 431 closes it, written last
        statuses.append(_statuses(transport))
    assert statuses == [[200, 200, 431], [200, 200, 431]]


async def test_a_repeat_is_answered_in_the_encoding_its_head_asked_for(server: Server) -> None:
    """Accept-Encoding is in the head a repeat takes again: each answer is compressed as
    the first was."""
    _, connect, _ = server
    protocol, transport = connect()
    for value in range(3):
        raw = binary_request(float(value), rows=200, extra=b"Accept-Encoding: gzip\r\n")
        protocol.data_received(raw)
        await _answers(transport, value + 1)
        assert protocol._repeat is not None and raw.startswith(protocol._repeat.head)
    items = Responses(bytes(transport.data)).items
    assert [item[1].get(b"content-encoding") for item in items] == [b"gzip"] * 3


def test_a_json_plan_answers_each_output_shape_as_the_full_encoder_does() -> None:
    """The answers of one JSON plan, cut once per output shape: each one byte for byte
    what encode_infer_response writes, shapes with no elements, values of another dtype
    and NaN included."""
    outputs = (TensorSpec("y", "FP32", (-1,)), TensorSpec("ok", "BOOL", (-1,)))
    model = ServedModel(
        "m", "1", "python", (TensorSpec("x", "FP32", (2,)),), outputs, Batcher(lambda x: x)
    )
    document = {
        "id": '"data":[]',
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
    }
    plans = InferPlans()
    results: list[dict[str, Any]] = [
        {"y": np.arange(3, dtype=np.float32)[None], "ok": np.array([[True, False]])},
        {"y": np.zeros((1, 0), dtype=np.float32), "ok": np.array([[1, 0, 2]])},
        {"y": np.arange(4, dtype=np.float64)[None] / 3, "ok": np.array([[False, True]])},
        {"y": np.array([[np.nan, 1.0]], dtype=np.float32), "ok": np.array([[True]])},
        {"y": np.array([[5.5, 6, 7]], dtype=np.float32), "ok": np.array([[False, True]])},
    ]
    plan = None
    for result in results:
        call = prepare_infer(model, orjson.dumps(document), None, plans)
        assert plan is None or call.plan is plan
        plan = call.plan
        status, body, _ = infer_response(model, call, result)
        tensors = [OutputTensor(s.name, result[s.name], s.datatype) for s in outputs]
        full, _ = encode_infer_response("m", "1", '"data":[]', tensors, set())
        assert (status, body) == (200, full)
    assert plan is not None and plan.json_answers is not None and len(plan.json_answers) == 4


# Not the header fields: read only while a head completes, and reset as the next begins.
_STATE = ("state", "_progress", "_first", "_url", "running")
_EXCHANGE = ("path", "header_length", "encoding", "http_version", "keep_alive", "size_bytes")
_EXCHANGE_FLAGS = ("is_received", "is_started", "is_too_large", "expects_continue")


def _state(protocol: Connection) -> tuple[Any, ...]:
    (exchange,) = protocol._queue
    return (
        tuple(getattr(protocol, name) is not None if name == "running" else getattr(protocol, name)
              for name in _STATE),
        protocol._timer.deadline is None,
        tuple(getattr(exchange, name) for name in (*_EXCHANGE, *_EXCHANGE_FLAGS)),
        exchange.queued is not None,
        protocol._expects_continue,
    )  # fmt: skip


async def test_the_repeat_lane_leaves_the_state_the_parser_s_callbacks_leave(
    server: Server,
) -> None:
    """A repeat with nothing before it is received and dispatched in one step: the
    connection and its cycle must be left as the parser's callbacks leave them."""
    _, connect, _ = server
    extra = b"Accept-Encoding: gzip\r\n"
    parsed, _ = connect()
    parsed.data_received(binary_request(1.0, extra=extra))
    after_parser = _state(parsed)
    repeated, transport = connect()
    parser = _counted(repeated)
    repeated.data_received(binary_request(1.0, extra=extra))
    await _answers(transport, 1)
    repeated.data_received(binary_request(1.0, extra=extra))
    assert parser.feeds == 1  # the second one took the lane
    assert _state(repeated) == after_parser
    await _answers(transport, 2)
