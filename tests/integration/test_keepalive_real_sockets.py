"""The keep-alive and stall timing of `carpool serve` (docs/server.md, "Connection
limits"), over real sockets against a real server process.

The wait that ``timeout_keep_alive`` (5 s) times is armed lazily in
``carpool.server.http.guards.WaitTimer``: an answer only moves the connection's deadline,
and one loop timer per connection catches up with it. These checks hold that timing to
what the docs promise, on the fast path and a route's handler (a query string) alike:

- an idle keep-alive connection is closed, silently, about 5 s after its LAST answer,
  also after hundreds of answers or a pipelined burst on it;
- a connection that sends a request every 3 s is never closed while it does;
- a head trickled a byte at a time gets a 408 about 5 s after the wait's start (its
  connect, or the answer before it): its bytes do not extend the wait;
- a body that stalls gets a 408 about 5 s after its last byte; one that keeps arriving,
  a byte a second for longer than 5 s, is served;
- pipelined requests, also behind a slow model or one that runs longer than 5 s, are all
  answered in order, and the connection is closed 5 s after the last answer;
- a request whose model runs 6 s is answered, not cut;
- SIGTERM with idle keep-alive connections open: they are closed at once, the request in
  flight is answered, and the process exits 0 without waiting out a keep-alive.

Every scenario is timed from the client, with bounds wide enough for a loaded 2-core
machine (a close between 4.5 s and 8 s after the last answer). The scenarios are
independent, so the module fixture runs them all at once on threads, one server; each
test waits for its own scenario's outcome.
"""

from __future__ import annotations

import concurrent.futures
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from .conftest import ServedProcess, read_until_closed, start_served_process, wait_until

KEEP_ALIVE_S = 5.0  # uvicorn's timeout_keep_alive, which carpool serve keeps
CLOSE_MIN_S = 4.5  # a close or 408 this long after the wait's start, at the earliest
CLOSE_MAX_S = 8.0  # and at the latest, on a loaded machine
SHUTDOWN_MAX_S = 3.5  # SIGTERM to exit with a 1 s request in flight (a keep-alive is 5 s)
SCENARIO_LIMIT_S = 90.0  # a net against a hung scenario, never a timing assertion

MODELS = '''\
"""Python models for test_keepalive_real_sockets: ``OUTPUT0 = 2 * INPUT0``, slowly."""

import time


def half_second(inputs):
    time.sleep(0.5)
    return {"OUTPUT0": inputs["INPUT0"] * 2}


def one_second(inputs):
    time.sleep(1.0)
    return {"OUTPUT0": inputs["INPUT0"] * 2}


def six_seconds(inputs):
    time.sleep(6.0)  # longer than timeout_keep_alive
    return {"OUTPUT0": inputs["INPUT0"] * 2}
'''

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
    source: keepalive_models:half_second
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 1
  - name: second
    kind: python
    source: keepalive_models:one_second
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 1
  - name: sleepy
    kind: python
    source: keepalive_models:six_seconds
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 8
    max_delay_s: 0.001
    num_replicas: 3
"""


def _start(folder: Path) -> ServedProcess:
    (folder / "keepalive_models.py").write_text(MODELS, encoding="utf-8")
    return start_served_process(CONFIG, folder)


# -- raw HTTP/1.1 over a socket ------------------------------------------------------------


def _body(i: int) -> bytes:
    tensor = {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [i, -i]}
    return orjson.dumps({"inputs": [tensor]})


def _path(model: str, asgi: bool) -> bytes:
    """The infer path; with a query string the request takes the ASGI path."""
    return f"/v2/models/{model}/infer{'?via=asgi' if asgi else ''}".encode()


def _request(model: str, i: int, *, asgi: bool = False) -> bytes:
    body = _body(i)
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
    return head % (_path(model, asgi), len(body)) + body


Answer = tuple[int, dict[bytes, bytes], bytes]


class _Connection:
    """One client connection; reads answers framed by Content-Length (carpool always
    sends one) and says when the server closed it."""

    def __init__(self, url: str) -> None:
        host, port = url.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.opened = time.monotonic()
        self.buffer = bytearray()
        self.answers = 0

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise AssertionError(
                f"the server closed the connection {time.monotonic() - self.opened:.2f} s "
                f"after it opened, after {self.answers} answers, with an answer awaited"
            )
        self.buffer += chunk

    def answer(self) -> Answer:
        """The next answer: (status, headers by lowercase name, body)."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        headers = dict(line.split(b": ", 1) for line in head[1:])
        headers = {name.lower(): value for name, value in headers.items()}
        assert b"content-length" in headers, head
        length = int(headers[b"content-length"])
        while len(self.buffer) < length:
            self._fill()
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        self.answers += 1
        return int(head[0].split()[1]), headers, body

    def readable_within(self, seconds: float) -> bool:
        return bool(select.select([self.sock], [], [], seconds)[0])

    def closed_at(self) -> float:
        """Waits for the server to close the connection (a reset counts); when it did.
        Nothing may arrive first."""
        rest = bytearray(self.buffer)
        try:
            while chunk := self.sock.recv(65536):
                rest += chunk
        except ConnectionResetError:
            pass
        closed = time.monotonic()
        assert not rest, f"unexpected bytes before the close: {bytes(rest[:200])!r}"
        return closed

    def error_when_closed(self) -> tuple[int, str]:
        """The one error answer the server sends before it closes: (status, message)."""
        status, headers, body = self.answer()
        assert headers.get(b"connection") == b"close", headers
        self.closed_at()
        return status, orjson.loads(body)["error"]

    def trickle(self, data: bytes, interval_s: float) -> float | None:
        """Sends ``data`` a byte every ``interval_s``; stops early when the server sends
        something (or closes), returning when it did; else None, all sent."""
        for byte in data:
            try:
                self.sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic()
            if self.readable_within(interval_s):
                return time.monotonic()
        return None


def _check_doubled(answer: Answer, i: int) -> None:
    status, _, body = answer
    assert status == 200, (status, body[:300])
    assert orjson.loads(body)["outputs"][0]["data"] == [2 * i, -2 * i], body[:300]


def _check_closed_after(when: float, closed: float, what: str) -> None:
    waited = closed - when
    assert CLOSE_MIN_S <= waited <= CLOSE_MAX_S, (
        f"closed {waited:.2f} s after {what}; timeout_keep_alive is {KEEP_ALIVE_S} s"
    )


# -- the scenarios: each raises AssertionError naming what went wrong --------------------


def _idle_after_200_answers(url: str) -> None:
    with _Connection(url) as conn:
        for i in range(200):
            conn.send(_request("doubler", i, asgi=i % 10 == 9))
            _check_doubled(conn.answer(), i)
        last = time.monotonic()
        _check_closed_after(last, conn.closed_at(), "the last of 200 answers")


def _idle_after_pipelined_burst(url: str) -> None:
    with _Connection(url) as conn:
        conn.send(b"".join(_request("doubler", i, asgi=i % 5 == 4) for i in range(50)))
        for i in range(50):
            _check_doubled(conn.answer(), i)
        last = time.monotonic()
        _check_closed_after(last, conn.closed_at(), "the last of 50 pipelined answers")


def _request_every_3_s(url: str) -> None:
    with _Connection(url) as conn:
        for k in range(6):  # at 0, 3, ..., 15 s: the connection is never idle for 5 s
            time.sleep(max(0.0, conn.opened + 3 * k - time.monotonic()))
            conn.send(_request("doubler", k, asgi=k % 2 == 1))
            _check_doubled(conn.answer(), k)
        last = time.monotonic()
        assert last - conn.opened >= 15.0  # the premise: active for over 15 s
        _check_closed_after(last, conn.closed_at(), "the last answer of a request every 3 s")


HEAD = b"POST /v2/models/doubler/infer HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200


def _head_trickled_from_connect(url: str) -> None:
    with _Connection(url) as conn:
        refused = conn.trickle(HEAD, 0.5)
        assert refused is not None, "a head trickled for 100 s was never refused"
        status, message = conn.error_when_closed()
        assert status == 408, message
        assert f"request head did not arrive in full within {KEEP_ALIVE_S:g} s" in message
        _check_closed_after(conn.opened, refused, "connecting, with a head trickling in")


def _head_trickled_after_an_answer(url: str) -> None:
    """The head's wait starts at the answer before it, not at the head's first byte."""
    with _Connection(url) as conn:
        conn.send(_request("doubler", 1))
        _check_doubled(conn.answer(), 1)
        answered = time.monotonic()
        time.sleep(3.0)  # idle: then 5 s from the answer is 2 s into the head
        refused = conn.trickle(HEAD, 0.5)
        assert refused is not None, "a head trickled for 100 s was never refused"
        status, message = conn.error_when_closed()
        assert status == 408, message
        waited = refused - answered
        assert CLOSE_MIN_S <= waited <= KEEP_ALIVE_S + 2.0, (
            f"408 {waited:.2f} s after the answer (the head began 3 s after it)"
        )


def _body_stalls(asgi: bool) -> Callable[[str], None]:
    def scenario(url: str) -> None:
        body = _body(7)
        head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
        with _Connection(url) as conn:
            conn.send(head % (_path("doubler", asgi), len(body)) + body[:-5])
            stalled = time.monotonic()
            assert conn.readable_within(30.0), "a stalled body was never refused"
            refused = time.monotonic()
            status, message = conn.error_when_closed()
            assert status == 408, message
            assert f"request body did not arrive in full within {KEEP_ALIVE_S:g} s" in message
            _check_closed_after(stalled, refused, "the body stalled")

    return scenario


def _body_trickles_a_byte_a_second(asgi: bool) -> Callable[[str], None]:
    def scenario(url: str) -> None:
        body = _body(8)
        head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
        with _Connection(url) as conn:
            conn.send(head % (_path("doubler", asgi), len(body)) + body[:-8])
            started = time.monotonic()
            early = conn.trickle(body[-8:-1], 1.0)  # 7 s, then the last byte
            if early is not None:
                answer = conn.answer()
                raise AssertionError(
                    f"answered {early - started:.2f} s into a body arriving a byte a "
                    f"second: {answer[0]} {answer[2][:200]!r}"
                )
            conn.send(body[-1:])
            _check_doubled(conn.answer(), 8)
            answered = time.monotonic()
            assert answered - started > KEEP_ALIVE_S + 1.0  # the premise: over 5 s
            _check_closed_after(answered, conn.closed_at(), "the answer to a trickled body")

    return scenario


def _body_trickles_then_stalls(url: str) -> None:
    """Each byte restarts the stall's wait: the 408 comes 5 s after the last one, over
    11 s after the head."""
    body = _body(9)
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
    with _Connection(url) as conn:
        conn.send(head % (_path("doubler", False), len(body)) + body[:-8])
        early = conn.trickle(body[-8:-4], 1.5)  # 6 s of progress, 4 bytes still owed
        assert early is None, f"refused {early - conn.opened:.2f} s into a trickling body"
        last_byte = time.monotonic() - 1.5
        assert conn.readable_within(30.0), "a stalled body was never refused"
        refused = time.monotonic()
        status, message = conn.error_when_closed()
        assert status == 408, message
        assert "request body did not arrive in full" in message
        _check_closed_after(last_byte, refused, "the body's last byte")


def _pipelined_slow(url: str) -> None:
    with _Connection(url) as conn:
        conn.send(b"".join(_request("slow", i, asgi=i % 2 == 1) for i in range(4)))
        for i in range(4):  # half a second each, one after the other
            _check_doubled(conn.answer(), i)
        last = time.monotonic()
        _check_closed_after(last, conn.closed_at(), "the last pipelined slow answer")


def _pipelined_behind_six_seconds(url: str) -> None:
    """The requests waiting behind a 6 s one are the server's turn: never timed."""
    with _Connection(url) as conn:
        sent = time.monotonic()
        conn.send(
            _request("sleepy", 1)
            + _request("doubler", 2, asgi=True)
            + _request("doubler", 3)
            + _request("slow", 4, asgi=True)
        )
        _check_doubled(conn.answer(), 1)
        assert time.monotonic() - sent > KEEP_ALIVE_S  # the premise: longer than 5 s
        for i in (2, 3, 4):
            _check_doubled(conn.answer(), i)
        last = time.monotonic()
        _check_closed_after(last, conn.closed_at(), "the last answer of the pipeline")


def _six_second_model(asgi: bool) -> Callable[[str], None]:
    def scenario(url: str) -> None:
        with _Connection(url) as conn:
            sent = time.monotonic()
            conn.send(_request("sleepy", 6, asgi=asgi))
            _check_doubled(conn.answer(), 6)
            answered = time.monotonic()
            assert answered - sent > KEEP_ALIVE_S  # the premise: the model ran over 5 s
            _check_closed_after(answered, conn.closed_at(), "the 6 s model's answer")

    return scenario


def _num_requests(url: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{url}/metrics", timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_requests_total" and sample.labels.get("model") == model
    )


def _sigterm_with_idle_connections(folder: Path) -> None:
    """Idle keep-alive connections (their answers just sent, so that their keep-alive
    has 5 s to run), one that never sent a byte and one in the middle of a head are closed
    at SIGTERM; the request in flight (1 s) is answered with connection: close, and the
    process exits 0 within SHUTDOWN_MAX_S, not after a keep-alive wait."""
    server = _start(folder)
    try:
        url = server.http_url
        silent = _Connection(url)
        partial = _Connection(url)
        partial.send(HEAD[:30])
        idle = [_Connection(url) for _ in range(4)]
        for i, conn in enumerate(idle):
            conn.send(_request("doubler", i, asgi=i % 2 == 1))
            _check_doubled(conn.answer(), i)
        inflight = _Connection(url)
        inflight.send(_request("second", 5))
        wait_until(lambda: _num_requests(url, "second") > 0, "the 1 s request to queue")
        server.process.send_signal(signal.SIGTERM)
        server.stopped = True
        signalled = time.monotonic()
        for conn in [silent, partial, *idle]:
            closed = conn.closed_at()
            conn.sock.close()
            assert closed - signalled <= 2.0, (
                f"an idle connection was closed {closed - signalled:.2f} s after SIGTERM"
            )
        status, headers, body = inflight.answer()
        inflight.closed_at()
        inflight.sock.close()
        assert status == 200 and headers.get(b"connection") == b"close", (status, headers)
        assert orjson.loads(body)["outputs"][0]["data"] == [10, -10]
        code = server.process.wait(timeout=60)
        exited = time.monotonic() - signalled
        assert code == 0, server.output()
        assert exited <= SHUTDOWN_MAX_S, f"exited {exited:.2f} s after SIGTERM"
        assert "Traceback" not in server.output(), server.output()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


SCENARIOS: dict[str, Callable[[str], None]] = {
    "idle_after_200_answers": _idle_after_200_answers,
    "idle_after_pipelined_burst": _idle_after_pipelined_burst,
    "request_every_3_s": _request_every_3_s,
    "head_trickled_from_connect": _head_trickled_from_connect,
    "head_trickled_after_an_answer": _head_trickled_after_an_answer,
    "body_stalls_fast": _body_stalls(False),
    "body_stalls_asgi": _body_stalls(True),
    "body_trickles_fast": _body_trickles_a_byte_a_second(False),
    "body_trickles_asgi": _body_trickles_a_byte_a_second(True),
    "body_trickles_then_stalls": _body_trickles_then_stalls,
    "pipelined_slow": _pipelined_slow,
    "pipelined_behind_six_seconds": _pipelined_behind_six_seconds,
    "six_second_model_fast": _six_second_model(False),
    "six_second_model_asgi": _six_second_model(True),
}

Runs = dict[str, "concurrent.futures.Future[None]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every scenario started at once on its own thread (the SIGTERM one with its own
    server); a test waits for its scenario's outcome."""
    server = _start(tmp_path_factory.mktemp("keepalive"))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS) + 1)
    try:
        futures: Runs = {
            name: pool.submit(scenario, server.http_url) for name, scenario in SCENARIOS.items()
        }
        futures["sigterm"] = pool.submit(
            _sigterm_with_idle_connections, tmp_path_factory.mktemp("keepalive-sigterm")
        )
        yield futures
        concurrent.futures.wait(futures.values(), timeout=SCENARIO_LIMIT_S)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        assert server.stop() == 0, server.output()
    assert "Traceback" not in server.output(), server.output()


def _outcome(runs: Runs, name: str) -> None:
    runs[name].result(timeout=SCENARIO_LIMIT_S)


def test_an_idle_connection_is_closed_5_s_after_the_last_of_200_answers(runs: Runs) -> None:
    _outcome(runs, "idle_after_200_answers")


def test_an_idle_connection_is_closed_5_s_after_a_pipelined_burst(runs: Runs) -> None:
    _outcome(runs, "idle_after_pipelined_burst")


def test_a_request_every_3_s_keeps_the_connection_open_for_15_s(runs: Runs) -> None:
    _outcome(runs, "request_every_3_s")


def test_a_trickled_head_gets_408_5_s_after_connecting(runs: Runs) -> None:
    _outcome(runs, "head_trickled_from_connect")


def test_a_trickled_head_gets_408_5_s_after_the_answer_before_it(runs: Runs) -> None:
    _outcome(runs, "head_trickled_after_an_answer")


@pytest.mark.parametrize("path", ["fast", "asgi"])
def test_a_stalled_body_gets_408_5_s_after_its_last_byte(runs: Runs, path: str) -> None:
    _outcome(runs, f"body_stalls_{path}")


@pytest.mark.parametrize("path", ["fast", "asgi"])
def test_a_body_arriving_a_byte_a_second_for_over_5_s_is_served(runs: Runs, path: str) -> None:
    _outcome(runs, f"body_trickles_{path}")


def test_a_body_that_trickles_then_stalls_gets_408_5_s_after_its_last_byte(
    runs: Runs,
) -> None:
    _outcome(runs, "body_trickles_then_stalls")


def test_pipelined_slow_requests_are_answered_in_order_then_closed_5_s_after(
    runs: Runs,
) -> None:
    _outcome(runs, "pipelined_slow")


def test_requests_pipelined_behind_a_6_s_one_are_answered_in_order(runs: Runs) -> None:
    _outcome(runs, "pipelined_behind_six_seconds")


@pytest.mark.parametrize("path", ["fast", "asgi"])
def test_a_model_running_6_s_is_answered_not_cut(runs: Runs, path: str) -> None:
    _outcome(runs, f"six_second_model_{path}")


def test_sigterm_closes_idle_connections_at_once_and_exits_promptly(runs: Runs) -> None:
    _outcome(runs, "sigterm")


# -- one connection to a server of its own: the wait armed at connect, and routes --------

CONNECTION_MODELS = '''\
"""The models of test_keepalive_real_sockets' connection tests."""

import time


def good(inputs):
    return {"Y": inputs["X"] * 2}


def sleepy(inputs):
    """Longer than uvicorn's timeout_keep_alive (5 s): its wait fires during the answer."""
    time.sleep(5.5)
    return {"Y": inputs["X"] * 2}
'''


def _entry(name: str, output: str, datatype: str, shape: str) -> str:
    return f"""\
  - name: {name}
    kind: python
    source: connection_models:{name}
    inputs: [{{name: X, datatype: FP32, shape: [4]}}]
    outputs: [{{name: {output}, datatype: {datatype}, shape: {shape}}}]
    max_batch_size: 8
    max_delay_s: 0.0
"""


CONNECTION_CONFIG = (
    "models:\n" + _entry("good", "Y", "FP32", "[4]") + _entry("sleepy", "Y", "FP32", "[4]")
)
X = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # two rows of four


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    folder = tmp_path_factory.mktemp("connection")
    (folder / "connection_models.py").write_text(CONNECTION_MODELS, encoding="utf-8")
    process = start_served_process(CONNECTION_CONFIG, folder)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()


def _connect(served: ServedProcess) -> socket.socket:
    host, port = served.http_url.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _post(path: bytes, body: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path, len(body))
    return head + body


def _good_request() -> bytes:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    return _post(b"/v2/models/good/infer", orjson.dumps(body))


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) read off a keep-alive connection."""
    data = b""
    answers: list[tuple[int, bytes]] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(answers)} answers"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length:")
        )
        while len(data) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed in the middle of an answer"
            data += chunk
        answers.append((int(lines[0].split()[1]), data[:length]))
        data = data[length:]
    assert data == b"", data
    return answers


def test_a_head_stalled_after_answers_gets_408(served: ServedProcess) -> None:
    """The wait after the last answer is the deadline for the next head: the timer armed
    at connect catches up with it, and a half request line then gets its 408."""
    with _connect(served) as sock:
        for _ in range(3):
            sock.sendall(_good_request())
            assert [status for status, _ in _read_answers(sock, 1)] == [200]
        sock.sendall(b"POST /v2/mod")
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", answer
    message = orjson.loads(body)["error"]
    assert f"request head did not arrive in full within {KEEP_ALIVE_S:g} s" in message


def test_pipelined_fast_and_asgi_requests_then_a_stalled_body_gets_408(
    served: ServedProcess,
) -> None:
    """Fast and ASGI requests pipelined in one write are answered in order; a body that
    then stops arriving gets a 408 naming the body."""
    ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    body = orjson.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    )
    stalled = b"POST /v2/models/good/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (
        len(body) + 5
    )
    with _connect(served) as sock:
        sock.sendall(_good_request() + ready + _good_request() + ready)
        statuses = [status for status, _ in _read_answers(sock, 4)]
        assert statuses == [200, 200, 200, 200]
        sock.sendall(stalled + body)
        answer = read_until_closed(sock)
    head, _, error = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", answer
    assert "request body did not arrive in full" in orjson.loads(error)["error"]


def test_an_answer_longer_than_the_keep_alive_wait_keeps_its_connection(
    served: ServedProcess,
) -> None:
    """The timer armed at connect fires while the model works past timeout_keep_alive: the
    answer arrives and the connection serves the next request, then closes idle."""
    body = orjson.dumps(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    )
    with _connect(served) as sock:
        sock.sendall(_post(b"/v2/models/sleepy/infer", body))
        assert [status for status, _ in _read_answers(sock, 1)] == [200]
        sock.sendall(_good_request())
        assert [status for status, _ in _read_answers(sock, 1)] == [200]
        assert read_until_closed(sock) == b""  # idle: closed without a word


def test_versioned_and_wrong_version_urls_are_routed_each_time(served: ServedProcess) -> None:
    """The route cache keeps only served URLs: a wrong version stays a 404 however often it
    is asked, and the versioned URL of the right one is answered on the fast path."""
    base = f"http://{served.http_url}/v2/models/good"
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": X[:4]}]}
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            assert client.post(f"{base}/versions/1/infer", json=body).status_code == 200
            assert client.post(f"{base}/versions/2/infer", json=body).status_code == 404
            assert client.post(f"{base}/infer", json=body).status_code == 200
            missing = client.post(f"http://{served.http_url}/v2/models/nope/infer", json=body)
            assert missing.status_code == 404
