"""Repeated heads (`carpool.server.heads`): a request whose bytes start with the head of the
connection's last fast-path request is taken without the parser. Each test holds the
answers to what the parser's path gives, and checks when the parser is, and is not,
skipped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from carpool.server.fasthttp import InferProtocol

from .test_fasthttp import (
    FakeTransport,
    Responses,
    Server,
    _binary_output,
    _binary_request,
    _json_request,
    _until,
    serving,
)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as served:
        yield served


LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"


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


def _counted(protocol: InferProtocol) -> CountingParser:
    counting = CountingParser(protocol.parser)
    protocol.parser = counting  # type: ignore[assignment]
    return counting


async def _answers(transport: FakeTransport, count: int) -> list[Any]:
    await _until(lambda: len(Responses(bytes(transport.data)).items) >= count)
    items = Responses(bytes(transport.data)).items
    assert len(items) == count
    return items


async def test_a_repeated_head_skips_the_parser_and_each_body_is_its_own(server: Server) -> None:
    _, connect, model = server
    protocol, transport = connect()
    parser = _counted(protocol)
    for i in range(4):
        protocol.data_received(_binary_request(float(i)))
        await _answers(transport, i + 1)
    items = Responses(bytes(transport.data)).items
    for i, item in enumerate(items):
        np.testing.assert_array_equal(_binary_output(item), [[2.0 * i, 2.0 * i]])
    assert parser.feeds == 1  # the first request's head was parsed, then kept
    assert model.seen == [0.0, 1.0, 2.0, 3.0]


async def test_json_requests_repeat_too(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    parser = _counted(protocol)
    for value in (1.0, 2.0):  # the same length of document: the same head
        tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}
        protocol.data_received(_json_request({"inputs": [tensor]}))
    items = await _answers(transport, 2)
    assert [item[2].count(b"[2.0,2.0]") + item[2].count(b"[4.0,4.0]") for item in items] == [1, 1]
    assert b"[2.0,2.0]" in items[0][2] and b"[4.0,4.0]" in items[1][2]
    assert parser.feeds == 1


async def test_pipelined_repeats_in_one_read_are_answered_in_order(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0))
    await _answers(transport, 1)
    parser = _counted(protocol)
    protocol.data_received(b"".join(_binary_request(float(v)) for v in (2, 3, 4)) + LIVE)
    items = await _answers(transport, 5)
    assert [_binary_output(item)[0, 0] for item in items[:4]] == [2.0, 4.0, 6.0, 8.0]
    assert items[4][0] == 200
    assert parser.feeds == 1  # the three repeats taken, the GET left to the parser


async def test_a_repeat_cut_short_by_the_read_goes_to_the_parser(server: Server) -> None:
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0))
    await _answers(transport, 1)
    raw = _binary_request(5.0)
    for cut in (len(raw) - 1, 10):  # the head whole but not the body; the head cut
        protocol.data_received(raw[:cut])
        protocol.data_received(raw[cut:])
    items = await _answers(transport, 3)
    assert [_binary_output(item)[0, 0] for item in items] == [2.0, 10.0, 10.0]


async def test_a_head_kept_before_another_route_is_still_answered_right(server: Server) -> None:
    """The parser's last message is then a GET: what the repeat takes is its own."""
    _, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0))
    protocol.data_received(LIVE)
    protocol.data_received(_binary_request(2.0))
    items = await _answers(transport, 3)
    assert items[1][0] == 200
    assert _binary_output(items[2])[0, 0] == 4.0


async def test_a_stopped_model_is_answered_as_the_parsers_path_answers_it(
    server: Server,
) -> None:
    app, connect, _ = server
    protocol, transport = connect()
    protocol.data_received(_binary_request(1.0))
    await _answers(transport, 1)
    await app.repository.get("m", None).batcher.stop()
    protocol.data_received(_binary_request(2.0))
    fresh, fresh_transport = connect()
    fresh.data_received(_binary_request(2.0))
    repeat, alone = (await _answers(transport, 2))[1], (await _answers(fresh_transport, 1))[0]
    assert repeat[0] == alone[0] == 503
    assert repeat[2] == alone[2]


async def test_heads_whose_parse_needs_the_parser_are_not_kept(server: Server) -> None:
    _, connect, _ = server
    raw = _binary_request(1.0)
    chunked_head, body = raw.split(b"\r\n\r\n", 1)
    chunked_head = chunked_head.replace(b"Content-Length", b"Transfer-Encoding: chunked\r\nX-Len")
    chunked = chunked_head + b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    heads = {
        "connection close": _binary_request(1.0, extra=b"Connection: close\r\n"),
        "expect": _binary_request(1.0, extra=b"Expect: 100-continue\r\n"),
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
    first, second = _binary_request(1.0), _binary_request(1.0, rows=2)
    protocol.data_received(first + second)
    await _answers(transport, 2)
    repeat = protocol._repeat
    assert repeat is not None and first.startswith(repeat.head)
    assert repeat.size == len(first) - len(repeat.head)
