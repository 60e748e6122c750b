"""`carpool serve` under a mix of concurrent faults, on every wire at once.

A gated model holds one request in the model while the others queue behind it, so what is
queued, cancelled, expired or computed is known exactly. Around that queue: clients that
hang up after half a body, after the whole body, in the middle of a pipeline; malformed
JSON, wrong shapes and datatypes, byte sizes that do not add up, an oversized body; gRPC
calls cancelled, past their deadline, streams cancelled with requests queued; requests
whose ``timeout`` expires in the queue; one value the model raises on; SIGTERM with all of
it in flight. The model logs every call (``tried``) and every call that succeeded
(``done``), so cancelled and expired requests are shown never to have computed and accepted
ones to have computed exactly once; ``/v2/models/{m}/stats`` must agree with what the
clients saw, and the server must hold no more tasks, threads or descriptors afterwards.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process, wait_until

LIMIT_S = 20.0  # only against hangs
POISON = 666

MODELS = f'''\
"""Models of test_fault_mix: a gated, logging model that raises on {POISON}, and a probe."""

import asyncio
import os
import threading
import time

import numpy as np


def _log(variable, values):
    with open(os.environ[variable], "a", encoding="utf-8") as sink:
        sink.write(" ".join(str(v) for v in values) + "\\n")


def faulty(inputs):
    """Y = 2 X. Logs each call's values to $FAULT_TRIED, blocks while $FAULT_GATE
    exists (at most 30 s), raises on {POISON}, logs a successful call to $FAULT_DONE."""
    x = inputs["X"]
    values = [int(v) for v in x.ravel()]
    _log("FAULT_TRIED", values)
    limit = time.monotonic() + 30.0
    while os.path.exists(os.environ["FAULT_GATE"]) and time.monotonic() < limit:
        time.sleep(0.005)
    if {POISON} in values:
        raise ValueError("poisoned by {POISON}")
    _log("FAULT_DONE", values)
    return {{"Y": x * 2}}


async def probe(inputs):
    """The server's asyncio tasks, threads and open descriptors, one row per input row."""
    row = [len(asyncio.all_tasks()), threading.active_count(), len(os.listdir("/proc/self/fd"))]
    return {{"N": np.array([row] * len(inputs["X"]), dtype=np.int64)}}
'''

CONFIG = """\
models:
  - name: faulty
    kind: python
    source: faultmodels:faulty
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 64
    max_delay_s: 0.001
  - name: probe
    kind: python
    source: faultmodels:probe
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: N, datatype: INT64, shape: [3]}]
    max_batch_size: 4
    max_delay_s: 0.001
"""

INFER = "/v2/models/faulty/infer"
ASGI_INFER = INFER + "?via=asgi"  # a query string: uvicorn's ASGI path, not the fast path


# -- the server and what its model logged ---------------------------------------------


@dataclass
class Fault:
    process: ServedProcess
    tried_file: Path
    done_file: Path
    gate: Path

    @property
    def http_url(self) -> str:
        return self.process.http_url

    @property
    def grpc_url(self) -> str:
        assert self.process.grpc_url is not None
        return self.process.grpc_url

    def calls(self, which: str = "tried") -> list[list[int]]:
        """One list of values per model call (``tried``) or successful call (``done``)."""
        path = self.tried_file if which == "tried" else self.done_file
        if not path.exists():
            return []
        return [[int(v) for v in line.split()] for line in path.read_text().splitlines()]

    def values(self, which: str = "tried") -> Counter[int]:
        return Counter(v for call in self.calls(which) for v in call)


def _start(folder: Path) -> Fault:
    (folder / "faultmodels.py").write_text(MODELS, encoding="utf-8")
    tried, done, gate = folder / "tried.txt", folder / "done.txt", folder / "gate"
    env = {"FAULT_TRIED": str(tried), "FAULT_DONE": str(done), "FAULT_GATE": str(gate)}
    return Fault(start_served_process(CONFIG, folder, grpc=True, env=env), tried, done, gate)


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fault]:
    served = _start(tmp_path_factory.mktemp("fault_mix"))
    try:
        yield served
    finally:
        served.gate.unlink(missing_ok=True)
        assert served.process.stop() == 0, served.process.output()
    assert "Traceback" not in served.process.output(), served.process.output()


# -- what the server reports ------------------------------------------------------------


def _stats(http_url: str) -> dict[str, int]:
    response = httpx.get(f"http://{http_url}/v2/models/faulty/stats", timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    stats = response.json()["model_stats"][0]
    return {
        "inference_count": stats["inference_count"],
        "execution_count": stats["execution_count"],
        "success": stats["inference_stats"]["success"]["count"],
        "fail": stats["inference_stats"]["fail"]["count"],
    }


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def _metrics(http_url: str) -> dict[str, float]:
    """The faulty model's pending requests and rejections by reason."""
    text = httpx.get(f"http://{http_url}/metrics", timeout=LIMIT_S).text
    found: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != "faulty":
                continue
            if sample.name == "carpool_pending_requests":
                found["pending"] += sample.value
            elif sample.name == "carpool_rejections_total":
                found[sample.labels["reason"]] += sample.value
    return dict(found)


class Watch:
    """Waits for the faulty model's queue and rejection counters to reach given values."""

    def __init__(self, http_url: str) -> None:
        self.http_url = http_url
        self.before = _metrics(http_url)

    def now(self, key: str) -> float:
        value = _metrics(self.http_url).get(key, 0.0)
        return value if key == "pending" else value - self.before.get(key, 0.0)

    def until(self, key: str, value: int) -> None:
        wait_until(lambda: self.now(key) == value, f"{key} == {value}")


# -- requests -------------------------------------------------------------------------


def _body(values: list[int], parameters: dict[str, Any] | None = None) -> bytes:
    document: dict[str, Any] = {
        "inputs": [{"name": "X", "shape": [len(values), 1], "datatype": "INT64", "data": values}]
    }
    if parameters:
        document["parameters"] = parameters
    return orjson.dumps(document)


def _post(http_url: str, path: str, content: bytes, headers: dict[str, str] | None = None) -> Any:
    response = httpx.post(f"http://{http_url}{path}", content=content, headers=headers, timeout=60)
    return response.status_code, response.json()


def _ys(document: dict[str, Any]) -> list[int]:
    return [int(v) for v in document["outputs"][0]["data"]]


def _raw(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: fault\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _connect(http_url: str) -> socket.socket:
    host, port = http_url.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=LIMIT_S)


def _triton_http(http_url: str, values: list[int]) -> list[int]:
    tensor = httpclient.InferInput("X", [len(values), 1], "INT64")
    tensor.set_data_from_numpy(np.array(values, dtype=np.int64).reshape(-1, 1), binary_data=True)
    client = httpclient.InferenceServerClient(http_url, network_timeout=60.0)
    try:
        result = client.infer("faulty", [tensor])
    finally:
        client.close()
    return [int(v) for v in result.as_numpy("Y").ravel()]


def _grpc_input(values: list[int], datatype: str = "INT64") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("X", [len(values), 1], datatype)
    dtype = np.int64 if datatype == "INT64" else np.int32
    tensor.set_data_from_numpy(np.array(values, dtype=dtype).reshape(-1, 1))
    return tensor


def _grpc(grpc_url: str, values: list[int], **kwargs: Any) -> list[int]:
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        result = client.infer("faulty", [_grpc_input(values)], **kwargs)
    finally:
        client.close()
    return [int(v) for v in result.as_numpy("Y").ravel()]


def _grpc_error(grpc_url: str, values: list[int], **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        _grpc(grpc_url, values, **kwargs)
    return str(caught.value.status()), str(caught.value.message())


def _hang_up_when_queued(fault: Fault, watch: Watch, data: bytes, pending: int) -> None:
    """Send ``data`` (a request, perhaps more), wait until it is queued, close: it must be
    withdrawn (cancelled) and the queue back to ``pending``."""
    cancelled = watch.now("cancelled")
    with _connect(fault.http_url) as sock:
        sock.sendall(data)
        watch.until("pending", pending + 1)
    watch.until("cancelled", int(cancelled) + 1)
    watch.until("pending", pending)


# -- 1. HTTP: every kind of fault around one queued batch -------------------------------

BAD_HTTP: dict[str, tuple[bytes, dict[str, str], int, list[str]]] = {
    "malformed JSON": (b'{"inputs": [{"name": "X",', {}, 400, []),
    "wrong shape": (
        orjson.dumps({"inputs": [{"name": "X", "shape": [2, 2], "datatype": "INT64",
                                  "data": [1, 2, 3, 4]}]}),
        {}, 400, ["'X'", "shape [2, 2]"],
    ),
    "wrong datatype": (
        orjson.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "FP32",
                                  "data": [1.0]}]}),
        {}, 400, ["'X'", "datatype FP32"],
    ),
    "element count": (
        orjson.dumps({"inputs": [{"name": "X", "shape": [3, 1], "datatype": "INT64",
                                  "data": [1, 2]}]}),
        {}, 400, ["'X'"],
    ),
    "byte size": (  # 16 bytes declared and sent where [1, 1] INT64 needs 8
        orjson.dumps({"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64",
                                  "parameters": {"binary_data_size": 16}}]}) + bytes(16),
        {"Inference-Header-Content-Length": "101"}, 400, ["binary_data_size"],
    ),
    "unknown input": (
        orjson.dumps({"inputs": [{"name": "Z", "shape": [1, 1], "datatype": "INT64",
                                  "data": [1]}]}),
        {}, 400, ["unknown input 'Z'"],
    ),
    "bad timeout": (_body([1], {"timeout": -5}), {}, 400, ["timeout"]),
}  # fmt: skip


def _bad_http(http_url: str, name: str) -> tuple[str, int, str]:
    content, headers, _, _ = BAD_HTTP[name]
    if name == "byte size":  # the header's real length
        header_length = content.index(b"}]}") + 3
        headers = {"Inference-Header-Content-Length": str(header_length)}
    status, document = _post(http_url, INFER, content, headers)
    return name, status, document["error"]


def _oversized(http_url: str) -> tuple[int, bytes]:
    """A body one byte over the 64 MiB limit, sent in full: a 413, then the server closes."""
    limit = 64 * 1024 * 1024
    head = (
        f"POST {INFER} HTTP/1.1\r\nhost: fault\r\ncontent-type: application/json\r\n"
        f"content-length: {limit + 1}\r\n\r\n"
    ).encode()
    with _connect(http_url) as sock:
        sock.sendall(head)
        chunk = b" " * (1024 * 1024)
        for _ in range(64):
            sock.sendall(chunk)
        sock.sendall(b" ")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    status = int(answer.split(b" ", 2)[1])
    return status, answer


def test_http_faults_around_a_queued_batch_harm_no_one_and_are_counted(fault: Fault) -> None:
    before, watch = _stats(fault.http_url), Watch(fault.http_url)
    tried_before, done_before = len(fault.calls()), len(fault.calls("done"))
    fault.gate.touch()
    pool = ThreadPoolExecutor(max_workers=24)
    try:
        blocker = pool.submit(_post, fault.http_url, INFER, _body([1000]))
        wait_until(lambda: 1000 in fault.values(), "the blocker to reach the model")
        goods: dict[str, Future[Any]] = {}
        for i in range(6):  # the fast path
            goods[f"fast {i}"] = pool.submit(_post, fault.http_url, INFER, _body([1100 + i]))
        for i in range(2):  # uvicorn's ASGI path
            goods[f"asgi {i}"] = pool.submit(_post, fault.http_url, ASGI_INFER, _body([1200 + i]))
        for i in range(2):  # binary tensors, two rows each
            goods[f"triton {i}"] = pool.submit(_triton_http, fault.http_url, [1300 + i, 1310 + i])
        poison = pool.submit(_post, fault.http_url, INFER, _body([1400, POISON]))
        expiring = [
            pool.submit(_post, fault.http_url, path, _body([1500 + i], {"timeout": 100_000}))
            for i, path in enumerate([INFER, ASGI_INFER])
        ]
        bad = [pool.submit(_bad_http, fault.http_url, name) for name in BAD_HTTP]
        too_large = pool.submit(_oversized, fault.http_url)
        queued = 6 + 2 + 2 + 1
        watch.until("deadline", 2)
        watch.until("pending", queued)

        # Clients that hang up while their request is queued: each is withdrawn.
        _hang_up_when_queued(fault, watch, _raw(INFER, _body([1600])), queued)
        _hang_up_when_queued(fault, watch, _raw(ASGI_INFER, _body([1601])), queued)
        pipelined = b"".join(_raw(INFER, _body([1602 + i])) for i in range(3))
        _hang_up_when_queued(fault, watch, pipelined, queued)
        pipelined = b"".join(_raw(ASGI_INFER, _body([1609 + i])) for i in range(2))
        _hang_up_when_queued(fault, watch, pipelined, queued)
        second = _raw(INFER, _body([1606]))
        _hang_up_when_queued(fault, watch, _raw(INFER, _body([1605])) + second[:40], queued)
        # A client that hangs up half way through its body never had a request.
        for path, value in ((INFER, 1607), (ASGI_INFER, 1608)):
            data = _raw(path, _body([value]))
            with _connect(fault.http_url) as sock:
                sock.sendall(data[: len(data) - 10])
        # One more good request after all that, on a connection of its own.
        goods["late"] = pool.submit(_post, fault.http_url, INFER, _body([1700]))
        watch.until("pending", queued + 1)
        bad_answers = [job.result(timeout=LIMIT_S) for job in bad]
        too_large_answer = too_large.result(timeout=LIMIT_S)
        expired = [job.result(timeout=LIMIT_S) for job in expiring]
    finally:
        fault.gate.unlink(missing_ok=True)
        pool.shutdown(wait=False)
    answers = {name: job.result(timeout=LIMIT_S) for name, job in goods.items()}
    poisoned = poison.result(timeout=LIMIT_S)
    assert blocker.result(timeout=LIMIT_S) == (200, blocker.result()[1])
    assert _ys(blocker.result()[1]) == [2000]
    pool.shutdown(wait=True)

    # Each good request got its own answer.
    for i in range(6):
        status, document = answers[f"fast {i}"]
        assert status == 200, document
        assert _ys(document) == [2 * (1100 + i)]
    for i in range(2):
        status, document = answers[f"asgi {i}"]
        assert status == 200, document
        assert _ys(document) == [2 * (1200 + i)]
        assert answers[f"triton {i}"] == [2 * (1300 + i), 2 * (1310 + i)]
    assert answers["late"][0] == 200 and _ys(answers["late"][1]) == [3400]
    # The poisoned request alone failed, though it rode in the others' batch.
    assert poisoned[0] == 500, poisoned
    assert "ValueError" in poisoned[1]["error"] and f"poisoned by {POISON}" in poisoned[1]["error"]
    big_batch = fault.calls()[tried_before + 1]
    assert POISON in big_batch and 1100 in big_batch and 1700 in big_batch
    for status, document in expired:
        assert status == 503, document
        assert "timeout" in document["error"]
    for name, status, message in bad_answers:
        assert status == BAD_HTTP[name][2], (name, status, message)
        for fragment in BAD_HTTP[name][3]:
            assert fragment in message, (name, message)
    status, raw_answer = too_large_answer
    assert status == 413, raw_answer
    assert b"connection: close" in raw_answer.lower()

    # Nothing cancelled, expired or half-sent was computed; every accepted value once.
    tried, done = fault.values("tried"), fault.values("done")
    never = {1500, 1501, *range(1600, 1611)}
    assert not never & set(tried), sorted(never & set(tried))
    accepted = [1000, *range(1100, 1106), 1200, 1201, 1300, 1301, 1310, 1311, 1700]
    assert sorted(v for v in done if v >= 1000) == sorted(accepted)
    assert max(done[v] for v in accepted) == 1
    assert done[POISON] == 0 and done[1400] == 0  # the poisoned request's other row

    # The statistics agree with what the clients saw.
    delta = _delta(_stats(fault.http_url), before)
    ok_requests = 1 + 6 + 2 + 2 + 1  # blocker, fast, asgi, triton, late
    assert delta["success"] == ok_requests
    assert delta["inference_count"] == ok_requests + 2  # the triton ones have two rows
    assert delta["fail"] == 1 + 2 + 5  # poison, expired, withdrawn
    # Executions are the model calls that succeeded: the blocker's, then each part of the
    # poisoned batch that ran clean while it was bisected.
    assert delta["execution_count"] == len(fault.calls("done")) - done_before
    assert delta["execution_count"] >= 3
    assert watch.now("cancelled") == 5
    assert watch.now("deadline") == 2
    assert watch.now("pending") == 0


# -- 2. gRPC: cancelled calls, deadlines, streams, bad tensors --------------------------


def test_grpc_faults_around_a_queued_batch_harm_no_one_and_are_counted(fault: Fault) -> None:
    before, watch = _stats(fault.http_url), Watch(fault.http_url)
    done_before = len(fault.calls("done"))
    fault.gate.touch()
    pool = ThreadPoolExecutor(max_workers=12)
    client = grpcclient.InferenceServerClient(fault.grpc_url)
    streamed: Queue[tuple[str, Any]] = Queue()
    cancelled_stream = grpcclient.InferenceServerClient(fault.grpc_url)
    try:
        blocker = pool.submit(_grpc, fault.grpc_url, [2000])
        wait_until(lambda: 2000 in fault.values(), "the blocker to reach the model")
        goods = {i: pool.submit(_grpc, fault.grpc_url, [2100 + i]) for i in range(4)}
        http_good = pool.submit(_post, fault.http_url, INFER, _body([2150]))

        def on_stream(result: Any, error: Any) -> None:
            if error is not None:
                streamed.put(("error", str(error)))
            else:
                response = result.get_response()
                streamed.put((response.id, [int(v) for v in result.as_numpy("Y").ravel()]))

        client.start_stream(callback=on_stream)
        for i in range(3):
            client.async_stream_infer("faulty", [_grpc_input([2200 + i])], request_id=f"s{i}")
        client.async_stream_infer("faulty", [_grpc_input([7], "INT32")], request_id="bad")
        client.async_stream_infer("faulty", [_grpc_input([POISON])], request_id="poison")
        queued = 4 + 1 + 3 + 1
        watch.until("pending", queued)
        unknown_version = _grpc_error(fault.grpc_url, [1, 2, 3], model_version="7")
        with pytest.raises(InferenceServerException) as caught:  # checked, never queued
            client.infer("faulty", [_grpc_input([1], "INT32")])
        wrong_type = caught.value
        expired = _grpc_error(fault.grpc_url, [2300], timeout=100_000)  # µs, in the queue
        watch.until("deadline", 1)

        # A call cancelled by its client while queued.
        answers: Queue[Any] = Queue()
        context = client.async_infer(
            "faulty",
            [_grpc_input([2400])],
            callback=lambda result, error: answers.put((result, error)),
        )
        watch.until("pending", queued + 1)
        context.cancel()
        watch.until("cancelled", 1)
        watch.until("pending", queued)
        # A call whose own deadline passes while queued.
        deadline = _grpc_error(fault.grpc_url, [2401], client_timeout=0.5)
        watch.until("cancelled", 2)
        # A stream cancelled with two requests queued.
        cancelled_stream.start_stream(callback=lambda result, error: answers.put((result, error)))
        for value in (2402, 2403):
            cancelled_stream.async_stream_infer("faulty", [_grpc_input([value])])
        watch.until("pending", queued + 2)
        cancelled_stream.stop_stream(cancel_requests=True)
        watch.until("cancelled", 4)
        watch.until("pending", queued)
    finally:
        fault.gate.unlink(missing_ok=True)
        pool.shutdown(wait=False)
    try:
        assert blocker.result(timeout=LIMIT_S) == [4000]
        for i, job in goods.items():
            assert job.result(timeout=LIMIT_S) == [2 * (2100 + i)]
        status, document = http_good.result(timeout=LIMIT_S)
        assert status == 200 and _ys(document) == [4300]
        stream_answers = [streamed.get(timeout=LIMIT_S) for _ in range(5)]
        client.stop_stream()
    finally:
        client.close()
        cancelled_stream.close()
        pool.shutdown(wait=True)
    assert streamed.empty()
    by_id = {key: value for key, value in stream_answers if key != "error"}
    assert by_id == {f"s{i}": [2 * (2200 + i)] for i in range(3)}
    errors = sorted(value for key, value in stream_answers if key == "error")
    assert len(errors) == 2, stream_answers
    assert "datatype INT32" in errors[0] or "datatype INT32" in errors[1], errors
    assert any(f"poisoned by {POISON}" in e for e in errors), errors
    assert unknown_version[0] == "StatusCode.NOT_FOUND", unknown_version
    assert wrong_type.status() == "StatusCode.INVALID_ARGUMENT"
    assert "datatype INT32" in str(wrong_type.message())
    assert expired[0] == "StatusCode.UNAVAILABLE" and "timeout" in expired[1], expired
    assert deadline[0] == "StatusCode.DEADLINE_EXCEEDED", deadline
    result, error = answers.get(timeout=LIMIT_S)
    assert result is None and error is not None and "CANCELLED" in str(error).upper()

    tried, done = fault.values("tried"), fault.values("done")
    never = {2300, 2400, 2401, 2402, 2403}
    assert not never & set(tried), sorted(never & set(tried))
    accepted = [2000, *range(2100, 2104), 2150, 2200, 2201, 2202]
    assert sorted(v for v in done if 2000 <= v < 3000) == sorted(accepted)

    delta = _delta(_stats(fault.http_url), before)
    assert delta["success"] == len(accepted)
    assert delta["inference_count"] == len(accepted)
    assert delta["fail"] == 1 + 1 + 4  # poison, expired, cancelled
    # The blocker's call, then each clean part of the poisoned batch's bisection.
    assert delta["execution_count"] == len(fault.calls("done")) - done_before
    assert delta["execution_count"] >= 3
    assert watch.now("pending") == 0


# -- 3. SIGTERM with all of it in flight -------------------------------------------------


def _refused(http_url: str) -> bool:
    try:
        _connect(http_url).close()
    except ConnectionRefusedError:
        return True
    return False


def _read_answer(sock: socket.socket) -> bytes:
    answer = b""
    while data := sock.recv(65536):
        answer += data
    return answer


def test_sigterm_with_faults_in_flight_answers_every_accepted_request(tmp_path: Path) -> None:
    fault = _start(tmp_path)
    watch = Watch(fault.http_url)
    fault.gate.touch()
    pool = ThreadPoolExecutor(max_workers=16)
    stream = grpcclient.InferenceServerClient(fault.grpc_url)
    streamed: Queue[tuple[Any, Any]] = Queue()
    try:
        blocker = pool.submit(_post, fault.http_url, INFER, _body([3000]))
        wait_until(lambda: 3000 in fault.values(), "the blocker to reach the model")
        goods: dict[int, Future[Any]] = {}
        for value in (3100, 3101, 3102):
            goods[value] = pool.submit(_post, fault.http_url, INFER, _body([value]))
        for value in (3200, 3201):
            goods[value] = pool.submit(_post, fault.http_url, ASGI_INFER, _body([value]))
        goods[3300] = pool.submit(_triton_http, fault.http_url, [3300])
        for value in (3400, 3401):
            goods[value] = pool.submit(_grpc, fault.grpc_url, [value])
        stream.start_stream(callback=lambda result, error: streamed.put((result, error)))
        for value in (3500, 3501):
            stream.async_stream_infer("faulty", [_grpc_input([value])], request_id=str(value))
        poison = pool.submit(_post, fault.http_url, INFER, _body([POISON]))
        expiring = pool.submit(_post, fault.http_url, INFER, _body([3600], {"timeout": 100_000}))
        queued = 3 + 2 + 1 + 2 + 2 + 1
        watch.until("deadline", 1)
        watch.until("pending", queued)
        _hang_up_when_queued(fault, watch, _raw(INFER, _body([3700])), queued)
        pipelined = _raw(INFER, _body([3701])) + _raw(INFER, _body([3702]))
        _hang_up_when_queued(fault, watch, pipelined, queued)
        # A client half way through its body when the signal comes; it finishes after.
        late_data = _raw(INFER, _body([3800]))
        late = _connect(fault.http_url)
        late.sendall(late_data[:-10])
        stats_before = _stats(fault.http_url)

        fault.process.process.send_signal(signal.SIGTERM)
        fault.process.stopped = True
        wait_until(lambda: "stopping" in fault.process.output(), "the server to say stopping")
        wait_until(lambda: _refused(fault.http_url), "new connections to be refused")
        late.sendall(late_data[-10:])  # its connection was accepted: it is answered
    finally:
        fault.gate.unlink(missing_ok=True)
        pool.shutdown(wait=False)
    try:
        late_answer = _read_answer(late)
        assert _ys(blocker.result(timeout=LIMIT_S)[1]) == [6000]
        for value, job in goods.items():
            answer = job.result(timeout=LIMIT_S)
            got = answer if isinstance(answer, list) else _ys(answer[1])
            assert got == [2 * value], (value, answer)
        stream_answers = {}
        for _ in range(2):
            result, error = streamed.get(timeout=LIMIT_S)
            assert error is None, error
            stream_answers[result.get_response().id] = int(result.as_numpy("Y")[0, 0])
        assert stream_answers == {"3500": 7000, "3501": 7002}
        status, document = poison.result(timeout=LIMIT_S)
        assert status == 500 and f"poisoned by {POISON}" in document["error"], document
        status, document = expiring.result(timeout=LIMIT_S)
        assert status == 503 and "timeout" in document["error"], document
        stream.stop_stream()
    finally:
        late.close()
        stream.close()
        pool.shutdown(wait=True)
        try:
            code = fault.process.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            fault.process.process.kill()
            fault.process.process.wait()
            raise
    assert code == 0, fault.process.output()
    head, _, body = late_answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), late_answer
    assert b"connection: close" in head.lower()
    assert _ys(orjson.loads(body)) == [7600]
    tried, done = fault.values("tried"), fault.values("done")
    assert not {3600, 3700, 3701, 3702} & set(tried)
    accepted = [3000, *goods, 3500, 3501, 3800]
    assert sorted(done) == sorted(accepted)
    assert stats_before["fail"] == 1 + 2  # expired, withdrawn (so far)
    output = fault.process.output()
    assert "Traceback" not in output, output
    assert output.rstrip().endswith("stopped"), output


# -- 4. no task, thread or descriptor outlives the load ---------------------------------


def _probe(http_url: str) -> tuple[int, int, int]:
    """The server's (asyncio tasks, threads, open descriptors), asked of the probe model."""
    body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [0]}]}
    response = httpx.post(f"http://{http_url}/v2/models/probe/infer", json=body, timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    tasks, threads, fds = response.json()["outputs"][0]["data"]
    return int(tasks), int(threads), int(fds)


def _fault_round(fault: Fault, base: int) -> None:
    """Good requests on every wire with faults between them, ungated; checks the good ones."""
    jobs: list[tuple[int, Future[Any]]] = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        for i in range(4):
            jobs.append((base + i, pool.submit(_post, fault.http_url, INFER, _body([base + i]))))
            value = base + 10 + i
            jobs.append((value, pool.submit(_post, fault.http_url, ASGI_INFER, _body([value]))))
            value = base + 20 + i
            jobs.append((value, pool.submit(_grpc, fault.grpc_url, [value])))
        jobs.append((base + 30, pool.submit(_triton_http, fault.http_url, [base + 30])))
        bad = [pool.submit(_bad_http, fault.http_url, name) for name in BAD_HTTP]
        poison = pool.submit(_post, fault.http_url, INFER, _body([POISON]))
        for path in (INFER, ASGI_INFER):  # hang-ups at every point of a request
            data = _raw(path, _body([base + 40])) * 2
            for cut in (len(data) // 4, len(data) // 2 - 5, len(data) // 2, len(data) - 3):
                with _connect(fault.http_url) as sock:
                    sock.sendall(data[:cut])
        client = grpcclient.InferenceServerClient(fault.grpc_url)
        try:
            client.async_infer(
                "faulty", [_grpc_input([base + 50])], callback=lambda result, error: None
            ).cancel()
            with pytest.raises(InferenceServerException):
                client.infer("faulty", [_grpc_input([1], "INT32")])
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("faulty", [_grpc_input([base + 60])])
            client.stop_stream(cancel_requests=True)
        finally:
            client.close()
        for value, job in jobs:
            answer = job.result(timeout=LIMIT_S)
            got = answer if isinstance(answer, list) else _ys(answer[1])
            assert got == [2 * value], (value, answer)
        assert all(job.result(timeout=LIMIT_S)[1] == 400 for job in bad)
        assert poison.result(timeout=LIMIT_S)[0] == 500


def test_no_task_thread_or_descriptor_outlives_a_faulty_load(fault: Fault) -> None:
    _fault_round(fault, 4000)  # warm: gRPC's and the executors' threads, the plans
    watch = Watch(fault.http_url)
    watch.until("pending", 0)
    tasks, threads, fds = before = _probe(fault.http_url)
    assert tasks >= 2 and threads >= 2 and fds >= 5, before  # the probe sees the server
    for base in (5000, 6000, 7000):
        _fault_round(fault, base)
    watch.until("pending", 0)
    after: list[tuple[int, int, int]] = []

    def settled() -> bool:
        after.append(_probe(fault.http_url))
        now_tasks, now_threads, now_fds = after[-1]
        return now_tasks <= tasks and now_threads <= threads and now_fds <= fds

    limit = time.monotonic() + LIMIT_S
    while not settled():
        assert time.monotonic() < limit, f"(tasks, threads, fds) {before} -> {after[-3:]}"
        time.sleep(0.05)  # polling another process until closed connections are gone
