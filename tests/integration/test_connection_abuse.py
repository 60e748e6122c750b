"""`carpool serve` against hostile or clumsy clients at the connection level: idle and
slowloris connections, huge heads, bad framing, a full file-descriptor table, pipelines
nobody reads, resets and SIGTERM with all of that open. Each test runs while a steady
stream of good infer requests goes on from another client; those must all be answered
correctly, and the server's memory must not follow what the bad client sends.

The tests whose docstrings start "Was:" failed before the fixes they name."""

from __future__ import annotations

import contextlib
import resource
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from carpool.server.http.guards import MAX_HEAD_BYTES, MAX_HEADER_FIELDS

from .conftest import (
    SendOne,
    ServedProcess,
    StartServer,
    Steady,
    read_until_closed,
    rss_kb,
    start_served_process,
    wait_until,
)

CONFIG = """\
models:
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 16
    max_delay_s: 0.002
  - name: slow
    kind: python
    source: configmodels:slow_double
    inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]
    max_batch_size: 8
    max_delay_s: 0.001
"""
INFER = b"/v2/models/doubler/infer"
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive, which carpool serve keeps
MEMORY_SLACK_KB = 32 * 1024  # far below what the bad clients send


def _body(i: int) -> bytes:
    tensor = {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [i, -i]}
    return orjson.dumps({"inputs": [tensor]})


def _request(i: int, *, path: bytes = INFER, extra: bytes = b"") -> bytes:
    body = _body(i)
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (path, len(body))
    return head + extra + b"\r\n" + body


def _connect(url: str) -> socket.socket:
    host, port = url.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _error(answer: bytes) -> tuple[int, str]:
    """(status, error message) of a single error answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head, head
    return int(head.split()[1]), orjson.loads(body)["error"]


@contextlib.contextmanager
def _keep_alive_session(url: str) -> Iterator[SendOne]:
    """Good infer requests over one keep-alive connection (Steady's session)."""
    with httpx.Client(timeout=60) as client:

        def send(i: int) -> str | None:
            response = client.post(f"http://{url}{INFER.decode()}", content=_body(i))
            data = response.json()["outputs"][0]["data"]
            if response.status_code != 200 or data != [2 * i, -2 * i]:
                return f"{response.status_code} {response.text[:200]}"
            return None

        yield send


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(CONFIG, tmp_path_factory.mktemp("abuse"))
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output()


@pytest.fixture
def steady(served: ServedProcess) -> Iterator[Steady]:
    stream = Steady(lambda: _keep_alive_session(served.http_url))
    yield stream
    stream.check()


# -- heads that never end -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "piece", "status", "fragment"),
    [
        (b"POST /v2/models/doubler/infer HTTP/1.1\r\nX-Big: ", b"a" * 65536, 431, "header"),
        (b"POST /v2/models/doubler/infer HTTP/1.1\r\n", b"X-H: v\r\n" * 8192, 431, "header"),
        (b"GET /v2/", b"a" * 65536, 414, "request target"),
    ],
    ids=["one-endless-header", "endless-headers", "endless-url"],
)
def test_a_head_that_keeps_growing_is_refused_before_memory_follows(
    served: ServedProcess, steady: Steady, start: bytes, piece: bytes, status: int, fragment: str
) -> None:
    """Was: uvicorn's httptools protocol (and httptools itself, for one field) buffered a
    head as long as it grew: 200 MB of one header value took the server to 300 MB of RSS,
    20 million small headers to 2.4 GB, and the loop stalled for seconds."""
    before = rss_kb(served.process.pid)
    sock = _connect(served.http_url)
    sent = 0
    with sock:
        try:
            sock.sendall(start)
            while sent < 64 * 1024 * 1024:  # the server must refuse long before this
                sock.sendall(piece)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(sock)
    assert sent < 64 * 1024 * 1024, "the server took 64 MiB of a head"
    got, message = _error(answer)
    assert got == status
    assert fragment in message and "the limit" in message
    assert rss_kb(served.process.pid) - before < MEMORY_SLACK_KB


def test_too_many_header_fields_and_a_1mb_header_are_refused(
    served: ServedProcess, steady: Steady
) -> None:
    """Was: 10,000 headers or a 1 MB header were read whole and served (200)."""
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    huge = b"X-Big: " + b"a" * (1 << 20) + b"\r\n"
    limits = [(many, f"over {MAX_HEADER_FIELDS} fields"), (huge, f"of {MAX_HEAD_BYTES} bytes")]
    for extra, fragment in limits:
        with _connect(served.http_url) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(_request(1, extra=extra))  # refused before it is all sent
            status, message = _error(read_until_closed(sock))
        assert status == 431
        assert "header fields" in message and fragment in message


@pytest.mark.parametrize("writes", [1, 40], ids=["one-write", "many-writes"])
@pytest.mark.parametrize(
    ("target", "extra", "status", "fragment"),
    [
        (b"/v2/models/" + b"m" * (70 * 1024), b"", 414, "request target of"),
        (INFER, b"X-Big: " + b"a" * (66 * 1024) + b"\r\n", 431, "header fields"),
    ],
    ids=["70-KiB-target", "66-KiB-header"],
)
def test_head_limits_hold_however_the_client_writes(
    served: ServedProcess,
    steady: Steady,
    target: bytes,
    extra: bytes,
    status: int,
    fragment: str,
    writes: int,
) -> None:
    """Was: a 70 KiB target sent in one write got 400 "User callback error" (httptools'
    URL parser takes at most 64 KiB) and a head of up to 256 KiB in one read was served;
    the documented 414 and 431 came only when the head arrived over several reads."""
    raw = _request(1, path=target, extra=extra)
    step = -(-len(raw) // writes)
    with _connect(served.http_url) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for start in range(0, len(raw), step):
                sock.sendall(raw[start : start + step])
                if writes > 1:
                    time.sleep(0.001)  # separate reads on the server's side
        got, message = _error(read_until_closed(sock))
    assert got == status
    assert fragment in message
    assert str(MAX_HEAD_BYTES) in message or str(MAX_HEAD_BYTES - 1) in message


def test_a_head_just_under_the_limit_is_served(served: ServedProcess, steady: Steady) -> None:
    extra = b"X-Big: " + b"a" * (60 * 1024) + b"\r\n"
    with _connect(served.http_url) as sock:
        sock.sendall(_request(3, extra=extra))
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")


# -- framing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: t\r\nNoColon\r\n\r\n", "header"),
        (b"BREW /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n", "method"),
        (_request(1, extra=b"Content-Length: 2\r\n"), "Content-Length"),
        (_request(1, extra=b"Transfer-Encoding: chunked\r\n"), "Transfer-Encoding"),
    ],
    ids=["no-colon", "unknown-method", "two-content-lengths", "content-length-and-chunked"],
)
def test_bad_framing_gets_a_400_naming_what_is_wrong(
    served: ServedProcess, steady: Steady, raw: bytes, fragment: str
) -> None:
    """Was: every parser error was a text/plain "Invalid HTTP request received.", naming
    nothing; now a JSON error as every other answer, with the parser's reason."""
    with _connect(served.http_url) as sock:
        sock.sendall(raw)
        status, message = _error(read_until_closed(sock))
    assert status == 400
    assert message.startswith("invalid HTTP/1.1 request") and fragment in message


def test_bad_bytes_after_pipelined_requests_are_refused_after_their_answers(
    served: ServedProcess, steady: Steady
) -> None:
    """Was: the 400 for bad bytes pipelined behind good requests was written at once and
    closed the connection, before the good requests' answers, which were lost. They are
    answered first, in order, and the 400 closes the connection after them."""
    good = _request(5) + _request(6, path=INFER + b"?via=asgi")
    with _connect(served.http_url) as sock:
        sock.sendall(good + b"NOT-HTTP\r\n\r\n" + _request(7))
        data = read_until_closed(sock)
    first, second, rest = data.split(b"HTTP/1.1 ", 3)[1:]
    for answer, value in [(first, 5), (second, 6)]:
        assert answer.startswith(b"200 "), answer
        body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["outputs"][0]["data"] == [2 * value, -2 * value]
    status, message = _error(b"HTTP/1.1 " + rest)
    assert status == 400 and message.startswith("invalid HTTP/1.1 request")


def _chunked(body: bytes, *, path: bytes = INFER, tail: bytes = b"0\r\n\r\n") -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % path
    return head + b"%x;name=value\r\n%s\r\n" % (len(body), body) + tail


def _answers(sock: socket.socket, count: int) -> list[httpx.Response]:
    """Reads ``count`` answers off a raw keep-alive socket."""
    import h11

    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
    connection.send(h11.EndOfMessage())
    answers: list[httpx.Response] = []
    status, body = 0, bytearray()
    while len(answers) < count:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status, body = event.status_code, bytearray()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            answers.append(httpx.Response(status, content=bytes(body)))
            connection.start_next_cycle()
            connection.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
            connection.send(h11.EndOfMessage())
    return answers


def test_chunked_bodies_with_extensions_and_trailers_are_served(
    served: ServedProcess, steady: Steady
) -> None:
    """Was (the trailer): a trailer field was merged into the request's headers, so a
    trailer ``Content-Encoding: gzip`` made the ASGI path inflate a plain body (400)."""
    trailer = b"0\r\nContent-Encoding: gzip\r\nX-Checksum: 1\r\n\r\n"
    with _connect(served.http_url) as sock:
        sock.sendall(_chunked(_body(3), tail=trailer))
        sock.sendall(_chunked(_body(4), path=INFER + b"?via=asgi", tail=trailer))
        fast, asgi = _answers(sock, 2)
    for answer, value in [(fast, 3), (asgi, 4)]:
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2 * value, -2 * value]


def test_a_chunked_body_over_the_limit_gets_413(served: ServedProcess, steady: Steady) -> None:
    chunk = b"a" * (1 << 20)
    with _connect(served.http_url) as sock:
        try:
            sock.sendall(_chunked(b"", tail=b"").partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
            for _ in range(80):  # 80 MiB, over the 64 MiB limit
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, message = _error(read_until_closed(sock))
    assert status == 413 and "exceeds the limit" in message


def test_http10_without_keep_alive_is_answered_and_closed(
    served: ServedProcess, steady: Steady
) -> None:
    body = _body(5)
    with _connect(served.http_url) as sock:
        sock.sendall(b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (INFER, len(body), body))
        answer = read_until_closed(sock)  # closed by the server: this returns
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head
    assert orjson.loads(body)["outputs"][0]["data"] == [10, -10]


# -- clients that send too little -------------------------------------------------------


def test_idle_slowloris_and_stalled_body_connections_are_closed(
    served: ServedProcess, steady: Steady
) -> None:
    """Was: nothing timed a connection before its first answer. Sockets that connected and
    sent nothing, sent half a request line, or a head and half the body its
    Content-Length promised, stayed open for ever (each holding a file descriptor)."""
    body = _body(6)
    stalled_body = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (
        INFER,
        len(body) + 5,
    )
    kinds = {"idle": b"", "half-line": b"POST /v2/mod", "half-body": stalled_body + body}
    sockets = {kind: [_connect(served.http_url) for _ in range(20)] for kind in kinds}
    for kind, data in kinds.items():
        for sock in sockets[kind]:
            sock.sendall(data)
    answers = {kind: [read_until_closed(s) for s in socks] for kind, socks in sockets.items()}
    for socks in sockets.values():
        for sock in socks:
            sock.close()
    assert set(answers["idle"]) == {b""}  # closed without a word, as after keep-alive
    for kind, what in [("half-line", "head"), ("half-body", "body")]:
        for answer in answers[kind]:
            status, message = _error(answer)
            assert status == 408
            assert f"request {what} did not arrive in full within {KEEP_ALIVE_S} s" in message


def test_a_slowloris_that_drips_bytes_is_closed_all_the_same(served: ServedProcess) -> None:
    """Was (with the test above): a byte now and then kept a head's wait going for ever."""
    sock = _connect(served.http_url)
    closed = threading.Event()
    answer: list[bytes] = []

    def read() -> None:
        answer.append(read_until_closed(sock))
        closed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with sock:
        for byte in b"POST /v2/models/doubler/infer HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
            if closed.wait(1.0):  # one byte a second: each well inside the keep-alive
                break
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
        reader.join(timeout=60)
    assert closed.is_set(), "the server kept a dripping head open"
    assert _error(answer[0])[0] == 408


def test_a_full_file_descriptor_table_recovers_once_idle_sockets_are_closed(
    tmp_path: Path,
) -> None:
    """Was: idle connections that took every descriptor were never closed, and the server
    took no new client for ever. At the limit uvloop (libuv) neither spins nor logs: it
    accepts each waiting connection on a spare descriptor and closes it at once. The
    idle ones are now closed after the keep-alive timeout, and new clients are served."""
    server = start_served_process(CONFIG, tmp_path)
    idle: list[socket.socket] = []
    try:
        resource.prlimit(server.process.pid, resource.RLIMIT_NOFILE, (256, 256))
        stream = Steady(lambda: _keep_alive_session(server.http_url))
        wait_until(lambda: stream.answered > 0, "the steady client to connect")
        idle += [_connect(server.http_url) for _ in range(400)]  # past the limit
        for sock in idle:
            assert read_until_closed(sock) == b""  # dropped, or closed once idle
        late = httpx.post(f"http://{server.http_url}{INFER.decode()}", content=_body(7))
        assert late.status_code == 200 and late.json()["outputs"][0]["data"] == [14, -14]
        stream.check()
    finally:
        for sock in idle:
            sock.close()
        assert server.stop() == 0, server.output()
    log = server.output()
    assert "Traceback" not in log and len(log.splitlines()) < 20, log[-3000:]


# -- clients that do not read, hang up half-way, or reset ----------------------------------


def test_a_client_that_pipelines_without_reading_is_held_back(
    served: ServedProcess, steady: Steady
) -> None:
    """The answers nobody reads stay bounded: reading pauses, so the client's own send
    blocks, and the server's memory does not follow what it tries to send."""
    before = rss_kb(served.process.pid)
    # Large answers (8192 values each) fill the socket buffers within a few hundred
    # requests; with two values each, tens of thousands of answers fit there first.
    tensor = {"name": "INPUT0", "shape": [1, 8192], "datatype": "FP32", "data": [1.5] * 8192}
    body = orjson.dumps({"inputs": [tensor]})
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (INFER, len(body))
    batch = (head + body) * 64  # about 2.5 MB
    sent = 0
    host, port = served.http_url.split(":")
    with socket.socket() as sock:
        # Small buffers on this side (set before connecting, so the window is small from
        # the start): the server's unread answers fill them in a few hundred requests,
        # not the megabytes loopback would otherwise buffer at a request every few ms.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.settimeout(5.0)  # a blocked send is the server holding back, as meant
        sock.connect((host, int(port)))
        try:
            while sent < 256 * 1024 * 1024:
                sock.sendall(batch)
                sent += len(batch)
        except TimeoutError:
            pass
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert sent < 256 * 1024 * 1024, "the server read 256 MiB nobody took answers for"
    assert rss_kb(served.process.pid) - before < MEMORY_SLACK_KB


def test_thousands_of_pipelined_requests_in_one_write_are_answered_in_order(
    served: ServedProcess, steady: Steady
) -> None:
    count = 2000  # far past the read-ahead (16 requests), each one a batch of its own
    with _connect(served.http_url) as sock:
        sender = threading.Thread(
            target=sock.sendall, args=(b"".join(_request(i) for i in range(count)),)
        )
        sender.start()
        answers = _answers(sock, count)
        sender.join(timeout=60)
    assert [a.status_code for a in answers] == [200] * count
    assert [a.json()["outputs"][0]["data"][0] for a in answers] == [2 * i for i in range(count)]


def test_a_half_closed_client_is_taken_as_gone(served: ServedProcess, steady: Steady) -> None:
    """A FIN after a complete request: the server cannot tell a half-close from a client
    that closed, so (as uvicorn, nginx and Go's net/http) the request is withdrawn and the
    connection closed; a client that wants its answer keeps its write side open."""
    with _connect(served.http_url) as sock:
        sock.sendall(_request(8))
        sock.shutdown(socket.SHUT_WR)
        answer = read_until_closed(sock)  # closed by the server: this returns
    assert answer == b"" or answer.startswith(b"HTTP/1.1 200")


def test_a_reset_in_the_middle_of_a_body_harms_nothing(
    served: ServedProcess, steady: Steady
) -> None:
    for _ in range(50):
        sock = _connect(served.http_url)
        raw = _request(9)
        sock.sendall(raw[: len(raw) - 10])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST


def _num_requests(url: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{url}/metrics", timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_requests_total" and sample.labels.get("model") == model
    )


# -- SIGTERM with all of that open -------------------------------------------------------


def test_sigterm_with_abusive_connections_open_exits_0_and_answers_the_accepted(
    start_server: StartServer,
) -> None:
    server = start_server(CONFIG)
    body = _body(1)
    stalled = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (INFER, len(body) + 5)
    opened = [_connect(server.http_url) for _ in range(30)]
    for i, sock in enumerate(opened):
        sock.sendall([b"", b"POST /v2/mod", stalled + body][i % 3])
    accepted = _connect(server.http_url)
    slow = orjson.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [21]}]}
    )
    accepted.sendall(
        b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
        % (len(slow), slow)
    )
    wait_until(lambda: _num_requests(server.http_url, "slow") > 0, "the slow request to queue")
    server.process.send_signal(signal.SIGTERM)
    server.stopped = True
    with accepted:
        answer = read_until_closed(accepted)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["outputs"][0]["data"] == [42]
    assert server.process.wait(timeout=60) == 0, server.output()
    for sock in opened:
        sock.close()
    assert "Traceback" not in server.output()


def test_a_websocket_upgrade_is_refused_cleanly(served: ServedProcess, steady: Steady) -> None:
    """Was: uvicorn took the upgrade and handed the app a websocket scope it ignores: a
    500 and an ERROR line per request. carpool serves no websocket route: the request is
    answered as plain HTTP/1.1 (no 101), and nothing is logged as an error."""
    upgrade = (
        b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    for _ in range(3):
        with _connect(served.http_url) as sock:
            sock.sendall(upgrade)
            answer = sock.recv(65536)
        status = int(answer.split()[1])
        assert status != 101 and status < 500, answer[:200]
    said = served.output()
    assert "ERROR" not in said and "Exception in ASGI" not in said, said[-2000:]
    assert "upgrade" not in said.lower(), said[-2000:]  # nor a warning per request
