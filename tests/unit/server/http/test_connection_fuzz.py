"""The HTTP protocol fuzzed (carpool.server.http.connection and dispatch): random runs of
HTTP/1.1 requests on one connection, cut at random byte boundaries, against each request
answered alone (the harness: fuzzing.py).

A run mixes requests the fast path answers (binary and JSON infer, valid and not, too
large, failing in the model) with requests a route's handler answers (health, metadata,
infer with a query or a gzipped body, an unknown model, an empty version), each maybe
with ``Connection: close``, ``Expect: 100-continue``, a chunked body or HTTP/1.0. The
client sends them pipelined and may hang up (EOF) or reset; the model holds its batches
until the test lets them go; time moves only when the test says (a FakeClock); the
transport behaves as asyncio's: it delivers no data while the protocol paused reading,
tells the protocol to pause writing past a high-water mark, and reports the connection
lost on the loop turn after it closes. Invariants:

* one final answer per request, in request order, each with the status and body the same
  request gets alone on a fresh connection (the ``date`` header aside);
* after an answer that closes the connection nothing more is answered, the transport is
  closed and nothing is written to it; a connection left open is reading again;
* a ``100 Continue`` only for a request that asked, just before its own answer;
* no exception escapes (into the caller, the loop's exception handler or the server's
  log);
* a client that hangs up gets a prefix of those answers, and the model never sees a
  fast-path request after the connection was lost;
* at the end nothing is left queued in the batcher and no handler task is running.

Then what the fast path must answer as a route's handler does (the same route with a
query string):

* Compression: each request carries random ``Accept-Encoding`` fields (none, one or
  several; mixed case, odd weights, unknown codings, garbage) and asks for an answer of
  a random size around ``MIN_COMPRESSED_BYTES``. Every answer is well framed; a 200 of at
  least 1 KiB is in the coding its own request chose (the first field, as both paths and
  Triton read it), and inflates to exactly the answer the same request gets without
  ``Accept-Encoding``; smaller answers and errors are never compressed; the fast path's
  answer is byte for byte the handler's.
* Parameters: ``timeout``, ``priority`` and an output's ``classification`` and
  ``binary_data`` of every JSON type (null, booleans, integers past 64 bits, floats with
  NaN and infinities, strings, lists, objects) give a valid answer or a 400 that names
  the parameter, as the handler does; never a 500, a hang or a closed connection.
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import orjson
from hypothesis import event, given, settings
from hypothesis import strategies as st

from carpool.server.encoding import MIN_COMPRESSED_BYTES, response_encoding
from carpool.server.http import connection
from carpool.server.http.connection import Connection
from carpool.server.http.guards import READ_AHEAD_BYTES

from .fuzzing import (
    FAST_KINDS,
    KINDS,
    MODIFIERS,
    SETTINGS,
    Answer,
    Reader,
    Server,
    Sized,
    Spec,
    Transport,
    _answers,
    _closes,
    _cut,
    _group,
    _request,
    _server,
    _watched,
    build,
    chunk_sizes,
    request_lists,
    sized_requests,
)

FAST_SETTINGS = settings(SETTINGS, max_examples=100)


# -- each request alone: the reference -------------------------------------------------

_ALONE: dict[bytes, Answer] = {}


async def _alone(server: Server, raw: bytes) -> Answer:
    """The final answer ``raw`` gets alone on a fresh connection (cached across runs)."""
    if raw in _ALONE:
        return _ALONE[raw]
    holds, server.model.holds = server.model.holds, [False]
    protocol, transport = server.connect()
    protocol.data_received(raw)
    finals: list[Answer] = []
    for _ in range(100):
        await server.tick()
        finals = [a for a in Reader(bytes(transport.data)).answers if a[0] != 100]
        if finals and not server.batcher.num_pending:
            break
    server.model.holds = holds
    assert len(finals) == 1, (raw, bytes(transport.data))
    transport.client_hangs_up()
    await server.tick()
    _ALONE[raw] = finals[0]
    return finals[0]


# -- a run on one connection ------------------------------------------------------------


STEPS = ("feed", "tick", "release", "read")


@dataclass
class Run:
    specs: list[Spec]
    chunk_sizes: list[int]
    holds: list[bool]
    steps: list[str]
    max_delay_s: float
    high_water_bytes: int | None = None
    read_ahead_bytes: int = READ_AHEAD_BYTES
    # Reads of whole requests (1-3 a read), as a client waiting for each answer sends
    # them: a read then starts with a head the connection had before (http/repeats.py).
    by_requests: bool = False


@st.composite
def runs(
    draw: st.DrawFn,
    *,
    write_flow: bool = False,
    hang_up: bool = False,
    kinds: tuple[str, ...] = KINDS,
    modifiers: tuple[str, ...] = MODIFIERS,
    num_requests: tuple[int, int] = (1, 12),
) -> Run:
    # Steps drawn from a few of them, weighted by repeats (swarm testing again).
    steps = draw(st.lists(st.sampled_from(STEPS), min_size=1, max_size=8))
    if hang_up:
        steps.append(draw(st.sampled_from(["hang_up", "reset"])))
    return Run(
        specs=draw(request_lists(kinds, modifiers, num_requests)),
        chunk_sizes=draw(st.lists(chunk_sizes, min_size=1, max_size=12)),
        holds=draw(st.lists(st.booleans(), min_size=1, max_size=4)),  # model calls held
        steps=draw(st.lists(st.sampled_from(steps), max_size=60)),
        max_delay_s=draw(st.sampled_from([0.0, 0.001])),
        high_water_bytes=draw(st.sampled_from([0, 300, 2000])) if write_flow else None,
        read_ahead_bytes=draw(st.sampled_from([READ_AHEAD_BYTES, 300, 3000])),
        by_requests=draw(st.booleans()),
    )


@dataclass
class Outcome:
    answers: list[Answer]
    num_begun: int
    transport: Transport
    protocol: Connection
    num_fed: int
    num_chunks: int
    num_pending: int
    num_tasks: int
    seen_after_lost: list[float]


async def _drive(server: Server, run: Run, values: list[float]) -> Outcome:
    raws = [build(spec, value) for spec, value in zip(run.specs, values, strict=True)]
    if run.by_requests:
        chunks = _group(raws, run.chunk_sizes)
    else:
        chunks = _cut(b"".join(raws), run.chunk_sizes)
    model, batcher = server.model, server.batcher
    model.holds = run.holds
    protocol, transport = server.connect(run.high_water_bytes)
    model.transport = transport
    num_fed = 0

    def feed() -> bool:
        nonlocal num_fed
        if num_fed == len(chunks) or not transport.reading or transport.closed:
            return False
        protocol.data_received(chunks[num_fed])
        num_fed += 1
        return True

    for step in run.steps:
        if step == "feed":
            feed()
        elif step == "tick":
            await server.tick()
        elif step == "release":
            model.release()
        elif step == "read":
            transport.client_reads()
        elif step == "hang_up":
            transport.client_hangs_up()
        else:
            transport.client_resets()
    # Then the client sends the rest and reads everything; the model lets everything go.
    for _ in range(300):
        while feed():
            pass
        model.release(len(model.held))
        transport.client_reads()
        await server.tick()
        is_quiet = not model.held and not batcher.num_pending and not protocol.tasks
        if is_quiet and (num_fed == len(chunks) or transport.closed or not transport.reading):
            break
    reader = Reader(bytes(transport.data))
    return Outcome(
        reader.answers,
        reader.num_begun,
        transport,
        protocol,
        num_fed,
        len(chunks),
        batcher.num_pending,
        len(protocol.tasks),
        model.seen_after_lost,
    )


def _check(run: Run, outcome: Outcome, alone: list[Answer], errors: list[str]) -> None:
    transport = outcome.transport
    assert not errors
    if not transport.closed_by_client:  # else the last answer may be cut short
        assert outcome.num_begun == len(outcome.answers), "an answer was cut short"
    assert (transport.writes_after_server_close, transport.writes_after_lost) == (0, 0)
    finals: list[Answer] = []
    is_continued = False  # a 100 Continue was sent for the request answered next
    for answer in outcome.answers:
        if answer[0] == 100:
            assert len(finals) < len(run.specs) and run.specs[len(finals)].is_expect
            assert not is_continued, "two 100 Continue for one request"
            is_continued = True
        else:
            finals.append(answer)
            is_continued = False
    closing = [i for i, answer in enumerate(alone) if _closes(answer)]
    expected = alone[: closing[0] + 1] if closing else alone
    if transport.closed_by_client:
        assert finals == expected[: len(finals)]
    else:
        assert finals == expected
        assert not is_continued
        assert transport.closed == bool(closing)
        if not transport.closed:
            assert outcome.num_fed == outcome.num_chunks, "reading stalled"
            assert transport.reading and not outcome.protocol.is_read_paused
    fast = {float(i + 1) for i, spec in enumerate(run.specs) if spec.is_fast}
    assert not fast.intersection(outcome.seen_after_lost), "the model got a request for nobody"
    assert (outcome.num_pending, outcome.num_tasks) == (0, 0)


async def _example(run: Run) -> None:
    server, repository = await _server(run.max_delay_s)
    try:
        with (
            _watched(server),
            mock.patch.object(connection, "READ_AHEAD_BYTES", run.read_ahead_bytes),
        ):
            values = [float(i + 1) for i in range(len(run.specs))]
            raws = [build(spec, value) for spec, value in zip(run.specs, values, strict=True)]
            alone = [await _alone(server, raw) for raw in raws]
            outcome = await _drive(server, run, values)
            transport = outcome.transport
            if not transport.closed:
                transport.client_hangs_up()
            await server.tick()
        _check(run, outcome, alone, server.errors)
    finally:
        await repository.stop()


@given(runs())
@SETTINGS
def test_pipelined_requests_are_answered_as_each_alone(run: Run) -> None:
    asyncio.run(_example(run))


@given(runs(write_flow=True))
@SETTINGS
def test_answers_survive_write_flow_control(run: Run) -> None:
    asyncio.run(_example(run))


@given(runs(write_flow=True, hang_up=True))
@SETTINGS
def test_a_client_that_hangs_up_gets_a_prefix_and_nothing_reaches_the_model(run: Run) -> None:
    asyncio.run(_example(run))


@given(runs(kinds=FAST_KINDS, modifiers=("expect", "chunked"), num_requests=(17, 24), hang_up=True))
@settings(SETTINGS, max_examples=40)
def test_long_pipelines_past_the_read_ahead_bound(run: Run) -> None:
    asyncio.run(_example(run))


# -- what the fuzzing found, kept as plain examples ---------------------------------------


async def test_413_held_while_writing_is_paused_is_not_replaced_by_a_400() -> None:
    """Was: with writing paused the 413 was held, but the cycle went on collecting the
    body and, at its end, was decoded as an infer call: the held 413 was replaced by a
    400 about the truncated body."""
    server, repository = await _server(max_delay_s=0.0)
    try:
        protocol, transport = server.connect()
        protocol.pause_writing()
        protocol.data_received(build(Spec("too_large"), 1.0))
        protocol.resume_writing()
        assert [status for status, _, _ in Reader(bytes(transport.data)).answers] == [413]
        assert transport.closed
    finally:
        await repository.stop()


async def test_an_answer_landing_as_the_client_hangs_up_is_not_written() -> None:
    """Was: the client's EOF closed the transport; the model answered the request in flight
    (its future done, the done-callback not yet run) before connection_lost, which then
    could not withdraw it and, with a pipelined request behind it, marked only that one
    disconnected: the answer was written to the lost connection (uvloop raises)."""
    server, repository = await _server(max_delay_s=0.0)
    try:
        protocol, transport = server.connect()
        protocol.data_received(build(Spec("binary"), 1.0) + build(Spec("binary"), 2.0))
        transport.client_hangs_up()  # connection_lost comes on the next loop turn
        await server.tick()
        assert server.model.seen == [1.0]  # the model ran it before the loss was reported
        assert (transport.lost, transport.writes_after_lost) == (True, 0)
    finally:
        await repository.stop()


# -- the fast path answers as the route's handler does --------------------------------


async def _answered_alone(server: Server, raw: bytes) -> Answer:
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
            fast = [
                _request(item, v, by_handler=False) for item, v in zip(items, values, strict=True)
            ]
            plain = [
                await _answered_alone(server, _request(item, v, by_handler=False, accept=False))
                for item, v in zip(items, values, strict=True)
            ]
            handled = [
                await _answered_alone(server, _request(item, v, by_handler=True))
                for item, v in zip(items, values, strict=True)
            ]
            answers, _ = await _answers(server, b"".join(fast), sizes)
        assert not server.errors
        closing = [i for i, answer in enumerate(plain) if _closes(answer)]
        expected = handled[: closing[0] + 1] if closing else handled
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
            assert answer == reference, "the fast path and the route's handler differ"
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


def _parameter_request(item: Parameterised, value: float, *, by_handler: bool) -> bytes:
    """The request with its parameters written as JSON text (NaN and Infinity as the
    literals tritonclient writes; integers of any size)."""
    path = b"/v2/models/m/infer" + (b"?q=1" if by_handler else b"")
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
                _parameter_request(item, v, by_handler=False)
                for item, v in zip(items, values, strict=True)
            ]
            handled = [
                await _answered_alone(server, _parameter_request(item, v, by_handler=True))
                for item, v in zip(items, values, strict=True)
            ]
            answers, _ = await _answers(server, b"".join(fast), sizes)
        assert not server.errors
        assert len(answers) == len(items), "the connection closed early"
        for item, answer, reference in zip(items, answers, handled, strict=True):
            status, _, body = answer
            assert status in (200, 400), (item, answer)
            event(f"{status}")
            if status == 400:
                message = orjson.loads(body)["error"]
                names = [*item.request, *(item.output or ())]
                assert any(name in message for name in names), (item, message)
            assert not _closes(answer), (item, answer)
            assert answer == reference, "the fast path and the route's handler differ"
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
        raw = _parameter_request(item, 1.0, by_handler=False)
        status, _, body = await _answered_alone(server, raw)
        assert status == 400
        assert "parameter 'timeout'" in orjson.loads(body)["error"]
    finally:
        await repository.stop()
