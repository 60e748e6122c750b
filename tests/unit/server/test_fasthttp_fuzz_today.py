"""The HTTP infer fast path fuzzed on what changed today: answers compressed under
``Accept-Encoding``, REST ``classification: 0`` as no classification, and the KServe
``timeout`` parameter as an integer.

Runs of requests pipelined on one connection, cut at random byte boundaries, through the
fake transport and server of :mod:`test_fasthttp_fuzz`; each request is also sent alone
through uvicorn's ASGI path (the same route with a query string), the reference.

* Compression: each request carries random ``Accept-Encoding`` fields (none, one or
  several; mixed case, odd weights, unknown codings, garbage) and asks for an answer of
  a random size around ``MIN_COMPRESSED_BYTES``. Every answer is well framed; a 200 of at
  least 1 KiB is in the coding its own request chose (the first field, as both paths and
  Triton read it), and inflates to exactly the answer the same request gets without
  ``Accept-Encoding``; smaller answers and errors are never compressed; the fast path's
  answer is byte for byte the ASGI path's.
* Parameters: ``timeout``, ``priority`` and an output's ``classification`` and
  ``binary_data`` of every JSON type (null, booleans, integers past 64 bits, floats with
  NaN and infinities, strings, lists, objects) give a valid answer or a 400 that names
  the parameter, as on the ASGI path; never a 500, a hang or a closed connection.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from hypothesis import event, given, settings
from hypothesis import strategies as st

from carpool.server.encoding import MIN_COMPRESSED_BYTES, response_encoding

from .test_fasthttp import _binary_request, _json_request
from .test_fasthttp_fuzz import (
    SETTINGS,
    Answer,
    Reader,
    Server,
    _closes,
    _cut,
    _insert_headers,
    _server,
    _watched,
    chunk_sizes,
)

FAST_SETTINGS = settings(SETTINGS, max_examples=100)

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


KINDS = ("binary", "json", "bad", "model_error", "too_large")


@dataclass(frozen=True)
class Sized:
    kind: str
    rows: int
    fields: tuple[bytes, ...]


def _request(item: Sized, value: float, *, asgi: bool, accept: bool = True) -> bytes:
    """The request's bytes; the ASGI path is taken for the same route with a query."""
    path = b"/v2/models/m/infer" + (b"?q=1" if asgi else b"")
    if item.kind == "json":
        tensor = {"name": "x", "shape": [item.rows, 2], "datatype": "FP32"}
        tensor["data"] = [value] * (2 * item.rows)
        raw = _json_request({"inputs": [tensor]}, path=path)
    elif item.kind == "bad":
        raw = _json_request({"inputs": []}, path=path)
    elif item.kind == "model_error":
        raw = _binary_request(-value, rows=item.rows, path=path)
    elif item.kind == "too_large":
        raw = _binary_request(value, rows=300, path=path)
    else:
        raw = _binary_request(value, rows=item.rows, path=path)
    if not accept or not item.fields:
        return raw
    return _insert_headers(raw, b"".join(field + b"\r\n" for field in item.fields))


@st.composite
def sized_requests(draw: st.DrawFn) -> list[Sized]:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
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
        is_quiet = not server.batcher.num_pending and not protocol.server_state.tasks
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


async def _alone(server: Server, raw: bytes) -> Answer:
    answers, _ = await _answers(server, raw, [len(raw)])
    assert len(answers) == 1, answers
    return answers[0]


def _header(answer: Answer, name: bytes) -> bytes | None:
    return next((value for key, value in answer[1] if key == name), None)


def _inflated(body: bytes, coding: bytes | None) -> bytes:
    if coding is None:
        return body
    inflater = zlib.decompressobj(31 if coding == b"gzip" else 15)  # deflate: zlib's wrapper
    data = inflater.decompress(body)
    assert inflater.eof and not inflater.unused_data, "not one whole compressed stream"
    return data


def _chosen(fields: tuple[bytes, ...]) -> bytes | None:
    """The coding the request's first Accept-Encoding field chooses."""
    return response_encoding(fields[0].partition(b":")[2].strip()) if fields else None


async def _compression_example(items: list[Sized], sizes: list[int]) -> None:
    server, repository = await _server(max_delay_s=0.0)
    try:
        with _watched(server):
            values = [float(i + 1) for i in range(len(items))]
            fast = [_request(item, v, asgi=False) for item, v in zip(items, values, strict=True)]
            plain = [
                await _alone(server, _request(item, v, asgi=False, accept=False))
                for item, v in zip(items, values, strict=True)
            ]
            asgi = [
                await _alone(server, _request(item, v, asgi=True))
                for item, v in zip(items, values, strict=True)
            ]
            answers, _ = await _answers(server, b"".join(fast), sizes)
        assert not server.errors
        closing = [i for i, answer in enumerate(plain) if _closes(answer)]
        expected = asgi[: closing[0] + 1] if closing else asgi
        assert len(answers) == len(expected)
        for item, answer, reference, alone in zip(items, answers, expected, plain, strict=False):
            status, _, body = answer
            coding = _header(answer, b"content-encoding")
            event(f"{status} in {coding!r}")
            is_large = len(alone[2]) >= MIN_COMPRESSED_BYTES
            assert coding == (_chosen(item.fields) if status == 200 and is_large else None), (
                item,
                answer[1],
            )
            assert status == alone[0]
            assert _inflated(body, coding) == alone[2], item
            assert (_header(answer, b"vary") is not None) == (coding is not None)
            headers = tuple(h for h in answer[1] if h[0] not in (b"content-encoding", b"vary"))
            assert headers == alone[1]  # Inference-Header-Content-Length: uncompressed JSON
            assert answer == reference, "the fast path and the ASGI path differ"
    finally:
        await repository.stop()


@given(sized_requests(), st.lists(chunk_sizes, min_size=1, max_size=6))
@FAST_SETTINGS
def test_pipelined_answers_are_each_compressed_as_their_own_request_asked(
    items: list[Sized], sizes: list[int]
) -> None:
    asyncio.run(_compression_example(items, sizes))


# -- parameters of every JSON type --------------------------------------------------------

INTEGERS = st.one_of(
    st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]),
    st.integers(-5, 5),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTEGERS,
    st.sampled_from([0.0, -0.0, 1.0, 1.5, 2.0, -1.0, 1e300, math.nan, math.inf, -math.inf]),
    st.sampled_from(["", "0", "1", "high", "low", "default"]),
)
JSON_VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=2),
    st.dictionaries(st.sampled_from(["a", "int64_param"]), SCALARS, max_size=2),
)
REQUEST_PARAMETERS = ("timeout", "priority")
OUTPUT_PARAMETERS = ("classification", "binary_data")


@dataclass(frozen=True)
class Parameterised:
    request: dict[str, Any]
    output: dict[str, Any] | None  # None: no outputs named
    is_binary: bool  # sent as tritonclient's binary request (JSON header, tensor bytes)


@st.composite
def parameterised(draw: st.DrawFn) -> Parameterised:
    request = draw(st.dictionaries(st.sampled_from(REQUEST_PARAMETERS), JSON_VALUES))
    output = None
    if draw(st.booleans()):
        output = draw(st.dictionaries(st.sampled_from(OUTPUT_PARAMETERS), JSON_VALUES))
    return Parameterised(request, output, draw(st.booleans()))


def _parameter_request(item: Parameterised, value: float, *, asgi: bool) -> bytes:
    """The request with its parameters written as JSON text (NaN and Infinity as the
    literals tritonclient writes; integers of any size)."""
    path = b"/v2/models/m/infer" + (b"?q=1" if asgi else b"")
    tensor: dict[str, Any] = {"name": "x", "shape": [1, 2], "datatype": "FP32"}
    document: dict[str, Any] = {"inputs": [tensor], "parameters": item.request}
    if item.output is not None:
        document["outputs"] = [{"name": "y", "parameters": item.output}]
    data = b""
    if item.is_binary:
        data = np.full(2, value, dtype=np.float32).tobytes()
        tensor["parameters"] = {"binary_data_size": len(data)}
    else:
        tensor["data"] = [value, value]
    header = json.dumps(document).encode()
    body = header + data
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (path, len(body))
    if item.is_binary:
        head += b"Inference-Header-Content-Length: %d\r\n" % len(header)
    return head + b"\r\n" + body


async def _parameters_example(items: list[Parameterised], sizes: list[int]) -> None:
    server, repository = await _server(max_delay_s=0.0)
    try:
        with _watched(server):
            values = [float(i + 1) for i in range(len(items))]
            fast = [
                _parameter_request(item, v, asgi=False)
                for item, v in zip(items, values, strict=True)
            ]
            asgi = [
                await _alone(server, _parameter_request(item, v, asgi=True))
                for item, v in zip(items, values, strict=True)
            ]
            answers, _ = await _answers(server, b"".join(fast), sizes)
        assert not server.errors
        assert len(answers) == len(items), "the connection closed early"
        for item, answer, reference in zip(items, answers, asgi, strict=True):
            status, _, body = answer
            assert status in (200, 400), (item, answer)
            event(f"{status}")
            if status == 400:
                message = orjson.loads(body)["error"]
                names = [*item.request, *(item.output or ())]
                assert any(name in message for name in names), (item, message)
            assert not _closes(answer), (item, answer)
            assert answer == reference, "the fast path and the ASGI path differ"
    finally:
        await repository.stop()


@given(st.lists(parameterised(), min_size=1, max_size=8), st.lists(chunk_sizes, max_size=6))
@FAST_SETTINGS
def test_any_parameter_value_is_an_answer_or_a_400_naming_it(
    items: list[Parameterised], sizes: list[int]
) -> None:
    asyncio.run(_parameters_example(items, sizes or [100_000]))


# -- what the fuzzing found, kept as plain examples ---------------------------------------


async def test_a_timeout_past_64_bits_beside_a_nan_is_a_400_naming_the_timeout() -> None:
    """Was: orjson reads an integer past 64 bits as a float, but a document with NaN is
    read again by the standard library, which kept it an int that orjson then could not
    write: the request was refused as invalid JSON at the NaN, which carpool accepts."""
    server, repository = await _server(max_delay_s=0.0)
    try:
        item = Parameterised({"timeout": 2**64, "x": math.nan}, None, is_binary=False)
        status, _, body = await _alone(server, _parameter_request(item, 1.0, asgi=False))
        assert status == 400
        assert "parameter 'timeout'" in orjson.loads(body)["error"]
    finally:
        await repository.stop()
