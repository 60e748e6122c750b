"""Raw bytes on the HTTP socket of one real `carpool serve` (the built-in models), fuzzed
with hypothesis: random bytes, and valid requests of every route (infer as JSON, binary,
chunked, gzipped and pipelined, OpenAI, health, metadata, metrics, HTTP/1.0, ``Expect:
100-continue``) with bytes flipped, inserted, cut or repeated, written in random pieces;
then the client says it is done (a half-close), or resets the connection.

Properties, for every case: everything the server writes parses as HTTP/1.1 answers
(httptools, the parser uvicorn uses), none of them a 5xx but the documented 501 and 503;
after the client's half-close the server ends the connection (within a net of 10 s,
never a timing assertion); after each property the server still answers its readiness
probe; over the module its RSS grows at most 50 MiB. Examples per property:
``CARPOOL_FUZZ_EXAMPLES``.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import socket
import struct
from collections.abc import Iterator

import httptools
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .fuzzing import (
    EMBEDDINGS,
    GENERATION,
    SETTINGS,
    Fuzzed,
    check_memory,
    fuzzed_server,
    is_http_fault,
)

CLOSE_LIMIT_S = 10.0  # a net against a connection left open, never a timing assertion
QUIET_S = 0.03  # no more bytes for this long: the answers to what was sent have come


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    with fuzzed_server(tmp_path_factory.mktemp("fuzz-socket"), "test_fuzz_socket") as server:
        for request in VALID * 2:  # the first of each allocates for good
            _exchange(server, [request], "half-close")
        server.log.rss_start_kib = server.rss_kib()
        yield server


@pytest.fixture(autouse=True)
def _still_serving(fuzzed: Fuzzed) -> Iterator[None]:
    yield
    fuzzed.check_alive()


def _post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: fuzz", f"Content-Length: {len(body)}", *headers]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def _chunked(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    half = len(body) // 2
    chunks = [body[:half], body[half:]]
    return head + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


_ROW = [0.25] * 256
_INFER = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": _ROW}]}
).encode()
_HEADER = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32",
                 "parameters": {"binary_data_size": 1024}}]}
).encode()  # fmt: skip
_BINARY = _HEADER + struct.pack("<256f", *_ROW)
VALID = [
    b"GET /v2/health/ready HTTP/1.1\r\nHost: fuzz\r\n\r\n",
    b"GET /v2/models/mlp HTTP/1.0\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: fuzz\r\nAccept-Encoding: gzip\r\n\r\n",
    _post("/v2/models/mlp/infer", _INFER, "Content-Type: application/json"),
    _post("/v2/models/mlp/infer", _BINARY, f"Inference-Header-Content-Length: {len(_HEADER)}"),
    _post("/v2/models/mlp/infer", gzip.compress(_INFER), "Content-Encoding: gzip"),
    _post("/v2/models/mlp/infer", _INFER, "Expect: 100-continue", "Connection: close"),
    _chunked("/v2/models/mlp/infer", _INFER),
    _post("/v1/embeddings", json.dumps({"model": EMBEDDINGS, "input": "fuzz"}).encode()),
    _post(
        "/v1/completions",
        json.dumps({"model": GENERATION, "prompt": "fuzz", "max_tokens": 2}).encode(),
    ),
    _post("/v2/repository/index", b"{}"),
    b"GET /v2/health/live HTTP/1.1\r\nHost: fuzz\r\n\r\n" * 2,  # pipelined
    b"GET /v2/health/live HTTP/1.1\r\nHost: fuzz\r\nConnection: Upgrade\r\nUpgrade: websocket"
    b"\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
]


class Answers:
    """httptools' view of what the server wrote: each answer's status, in order."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())


def _read_until_closed(sock: socket.socket, received: bytearray, timeout_s: float) -> bool:
    """Reads until the server ends the connection (True), or until ``timeout_s`` pass
    without a byte (False: still open)."""
    sock.settimeout(timeout_s)
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _exchange(fuzzed: Fuzzed, pieces: list[bytes], ending: str) -> None:
    """Write ``pieces`` on a new connection and end as ``ending`` says: "half-close" at
    once, "wait" for the answers and then half-close, or "reset"; then check what came."""
    host, port = fuzzed.process.http_url.split(":")
    received = bytearray()
    with socket.create_connection((host, int(port)), timeout=CLOSE_LIMIT_S) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already refused and closed: what it wrote is still there
        if ending == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            fuzzed.log.saw("reset", "", is_fault=False)
            return
        closed = ending == "wait" and _read_until_closed(sock, received, QUIET_S)
        if not closed:
            with contextlib.suppress(OSError):  # already reset by the server
                sock.shutdown(socket.SHUT_WR)
            closed = _read_until_closed(sock, received, CLOSE_LIMIT_S)
    sent = b"".join(pieces)
    what = f"{sent[:300]!r} ({len(sent)} bytes, {ending})"
    answers = Answers()
    try:
        answers.parser.feed_data(bytes(received))
    except httptools.HttpParserError as error:
        raise AssertionError(f"not HTTP ({error}): {bytes(received[:300])!r} for {what}") from None
    for status in answers.statuses:
        assert fuzzed.log.saw(status, what, is_fault=is_http_fault(status)), (status, what)
    if not answers.statuses:
        fuzzed.log.saw("none", what, is_fault=False)
    assert closed, f"the connection was still open {CLOSE_LIMIT_S} s after the half-close: {what}"


@st.composite
def pieces_of(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut into up to four pieces at random places."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


ENDINGS = st.sampled_from(["half-close", "wait", "wait", "reset"])


@SETTINGS
@given(data=st.binary(min_size=1, max_size=512), ending=ENDINGS, cut=st.data())
def test_random_bytes_get_well_formed_answers_and_a_closed_connection(
    fuzzed: Fuzzed, data: bytes, ending: str, cut: st.DataObject
) -> None:
    _exchange(fuzzed, cut.draw(pieces_of(data)), ending)


MUTATION_BYTES = st.sampled_from(
    [b"\r\n", b"\r\n\r\n", b"\0", b":", b" ", b"\n", b"0", b"9" * 12, b"-1", b"chunked", b"\xff"]
) | st.binary(min_size=1, max_size=8)


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """A valid request (or two, pipelined) with one to four mutations."""
    data = bytearray(draw(st.sampled_from(VALID)))
    if draw(st.integers(0, 4)) == 0:
        data += draw(st.sampled_from(VALID))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "cut", "repeat", "upper"]))
        if kind == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data[at:at] = draw(MUTATION_BYTES)
        elif kind == "cut":
            del data[at : at + draw(st.integers(1, 32))]
        elif kind == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
        else:
            data[at : at + 16] = bytes(data[at : at + 16]).upper()
    return bytes(data)


@SETTINGS
@given(request=mutated_requests(), ending=ENDINGS, cut=st.data())
def test_mutated_requests_get_well_formed_answers_and_a_closed_connection(
    fuzzed: Fuzzed, request: bytes, ending: str, cut: st.DataObject
) -> None:
    _exchange(fuzzed, cut.draw(pieces_of(request)), ending)


def test_memory_grew_at_most_50_mib_over_the_module(fuzzed: Fuzzed) -> None:
    check_memory(fuzzed)
