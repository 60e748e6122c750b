"""A client that goes away cancels its queued request, on every face of the server.

A gated model (it blocks while a file exists, and logs every row it computes) holds the
replica busy, so the requests sent after it wait; then their clients leave; then the gate
opens. A request whose client left must never reach the model, be counted as cancelled in
``/metrics`` (``carpool_rejections_total{reason="cancelled"}``, not completed, not
failed) and in ``/v2/models/{m}/stats`` (Triton's shape has no cancelled field: ``fail``,
never ``success``), free its queue slot at once, and leave the other requests of its
batch answered. Faces: the HTTP fast path (binary and JSON bodies), the ASGI path (a query
string, a gzip body), pipelined requests on a closed connection, gRPC unary calls
(cancelled, past their deadline) and a cancelled stream. A client that leaves while its
request computes is answered to nobody: no error is logged, and the request counts as
completed (the model ran it).

A threaded replica holds the next *full* batch on its thread behind the one it computes
(pipeline depth 2); a request of that waiting batch whose caller cancels is withdrawn
when the batch's turn comes and the rest of the batch runs without it (tested on the
:class:`Batcher` directly, where the cancel and the turn are ordered exactly, and through
the server's fast path).
"""

from __future__ import annotations

import asyncio
import gzip
import queue
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from carpool import Batcher, BatchPolicy

from .conftest import ServedProcess, start_served_process, wait_until

LIMIT_S = 30.0  # only against hangs
MAX_BATCH = 4

MODELS = '''\
"""The gated, logging model of test_disconnect_cancels."""

import os
import time


def rec(inputs):
    """Y = X. Logs each call's rows to $DC_SEEN, then blocks while $DC_GATE exists, or
    while $DC_GATE-<v> does for the call's first value v."""
    x = inputs["X"]
    with open(os.environ["DC_SEEN"], "a", encoding="utf-8") as seen:
        seen.write(" ".join(str(int(v)) for v in x.ravel()) + "\\n")
    gates = (os.environ["DC_GATE"], os.environ["DC_GATE"] + "-" + str(int(x.ravel()[0])))
    limit = time.monotonic() + 30.0
    while any(os.path.exists(g) for g in gates) and time.monotonic() < limit:
        time.sleep(0.005)
    return {"Y": x}
'''

CONFIG = f"""\
models:
  - name: rec
    kind: python
    source: dcmodels:rec
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: {MAX_BATCH}
    max_delay_s: 0.001
    executor: thread
"""


# -- the server, its model's log and its counters --------------------------------------


@dataclass
class Served:
    process: ServedProcess
    seen_file: Path
    gate: Path

    @property
    def http_url(self) -> str:
        return self.process.http_url

    @property
    def grpc_url(self) -> str:
        assert self.process.grpc_url is not None
        return self.process.grpc_url

    def calls(self) -> list[list[int]]:
        if not self.seen_file.exists():
            return []
        lines = self.seen_file.read_text().splitlines()
        return [[int(v) for v in line.split()] for line in lines]

    def seen(self) -> set[int]:
        return {v for call in self.calls() for v in call}

    def counts(self) -> dict[str, float]:
        """The model's counters: /metrics' and /stats'."""
        text = httpx.get(f"http://{self.http_url}/metrics", timeout=LIMIT_S).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model") != "rec":
                    continue
                key = sample.name
                if sample.name == "carpool_rejections_total":
                    key = f"rejected:{sample.labels['reason']}"
                found[key] = found.get(key, 0.0) + sample.value
        stats = httpx.get(f"http://{self.http_url}/v2/models/rec/stats", timeout=LIMIT_S)
        inference = stats.json()["model_stats"][0]["inference_stats"]
        found["stats:success"] = inference["success"]["count"]
        found["stats:fail"] = inference["fail"]["count"]
        return found


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("disconnect_cancels")
    (folder / "dcmodels.py").write_text(MODELS, encoding="utf-8")
    seen, gate = folder / "seen.txt", folder / "gate"
    env = {"DC_SEEN": str(seen), "DC_GATE": str(gate)}
    server = Served(start_served_process(CONFIG, folder, grpc=True, env=env), seen, gate)
    try:
        yield server
    finally:
        server.gate.unlink(missing_ok=True)
        assert server.process.stop() == 0, server.process.output()
    output = server.process.output()
    assert "Traceback" not in output and "ERROR" not in output, output


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    keys = (
        "carpool_requests_completed_total",
        "carpool_requests_failed_total",
        "rejected:cancelled",
        "stats:success",
        "stats:fail",
    )
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def _expected(completed: int, cancelled: int) -> dict[str, float]:
    return {
        "carpool_requests_completed_total": completed,
        "carpool_requests_failed_total": 0,
        "rejected:cancelled": cancelled,
        "stats:success": completed,
        "stats:fail": cancelled,  # Triton's statistics have no cancelled field
    }


# -- raw HTTP/1.1: the client decides exactly when it goes away --------------------------


def _json_body(value: int) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [value]}]}
    )


def _request(value: int, *, kind: str = "json", path: str = "/v2/models/rec/infer") -> bytes:
    """One infer request: ``json``, ``binary`` (tritonclient's binary tensor data) or
    ``gzip`` (a JSON body sent with ``Content-Encoding: gzip``)."""
    headers = {"host": "test", "content-type": "application/json"}
    if kind == "binary":
        header = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "X",
                        "shape": [1, 1],
                        "datatype": "INT64",
                        "parameters": {"binary_data_size": 8},
                    }
                ]
            }
        )
        body = header + struct.pack("<q", value)
        headers["content-type"] = "application/octet-stream"
        headers["inference-header-content-length"] = str(len(header))
    elif kind == "gzip":
        body = gzip.compress(_json_body(value))
        headers["content-encoding"] = "gzip"
    else:
        body = _json_body(value)
    headers["content-length"] = str(len(body))
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def _connect(served: Served) -> socket.socket:
    host, port = served.http_url.split(":")
    sock = socket.create_connection((host, int(port)), timeout=LIMIT_S)
    return sock


def _leave(sock: socket.socket, served: Served) -> None:
    """Go away, and return once the server has seen it: end the sending side, wait for
    the server to close its own (it closes the connection on EOF, right after telling
    its protocol), then one more request through the server's loop."""
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(65536):
        pass  # an answer here would be a failure: the test checks what was computed
    sock.close()
    httpx.get(f"http://{served.http_url}/v2/health/live", timeout=LIMIT_S)


def _answer_y(sock: socket.socket) -> int:
    """Read one HTTP answer (a JSON infer response) and return its ``Y``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                 .split(b":")[1])  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return int(orjson.loads(body)["outputs"][0]["data"][0])


class _Hold:
    """The replica busy with a blocker (value ``blocker``) until ``release()``."""

    def __init__(self, served: Served, blocker: int) -> None:
        self.served = served
        self.blocker = blocker
        served.gate.touch()
        self.sock = _connect(served)
        self.sock.sendall(_request(blocker))
        wait_until(lambda: blocker in served.seen(), "the blocker to reach the model")

    def release(self) -> None:
        self.served.gate.unlink(missing_ok=True)
        assert _answer_y(self.sock) == self.blocker
        self.sock.close()


def _pending(served: Served) -> float:
    return served.counts().get("carpool_pending_requests", 0.0)


# -- the HTTP faces ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("json", "/v2/models/rec/infer"),  # the fast path
        ("binary", "/v2/models/rec/infer"),  # the fast path, binary tensor data
        ("binary", "/v2/models/rec/versions/1/infer"),  # the fast path, a version
        ("json", "/v2/models/rec/infer?via=asgi"),  # a query string: the ASGI path
        ("gzip", "/v2/models/rec/infer"),  # a compressed body: the ASGI path
    ],
)
def test_http_client_leaving_withdraws_its_queued_request(
    served: Served, kind: str, path: str
) -> None:
    base = 1000 + 100 * len(served.calls())  # values unique across the module's tests
    before = served.counts()
    hold = _Hold(served, base)
    try:
        stayer, leaver = _connect(served), _connect(served)
        stayer.sendall(_request(base + 1, kind=kind, path=path))
        leaver.sendall(_request(base + 2, kind=kind, path=path))
        wait_until(lambda: _pending(served) == 2, "both requests to queue")
        _leave(leaver, served)
        # The slot is freed at once, before the model gets to the batch.
        wait_until(lambda: _pending(served) == 1, "the queue to let the cancelled one go")
    finally:
        hold.release()
    assert _answer_y(stayer) == base + 1
    stayer.close()
    assert base + 2 not in served.seen()
    assert [base + 1] in served.calls()
    assert _delta(served.counts(), before) == _expected(completed=2, cancelled=1)


@pytest.mark.parametrize("first", ["/v2/models/rec/infer", "/v2/models/rec/infer?via=asgi"])
def test_pipelined_requests_of_a_closed_connection_are_never_computed(
    served: Served, first: str
) -> None:
    base = 1000 + 100 * len(served.calls())
    before = served.counts()
    hold = _Hold(served, base)
    try:
        sock = _connect(served)
        sock.sendall(_request(base + 1, path=first) + _request(base + 2) + _request(base + 3))
        wait_until(lambda: _pending(served) == 1, "the first request to queue")
        _leave(sock, served)
        wait_until(lambda: _pending(served) == 0, "the queue to let it go")
    finally:
        hold.release()
    assert not {base + 1, base + 2, base + 3} & served.seen()
    # Only the first was queued; those behind it were never taken from the connection.
    assert _delta(served.counts(), before) == _expected(completed=1, cancelled=1)


@pytest.mark.parametrize("path", ["/v2/models/rec/infer", "/v2/models/rec/infer?via=asgi"])
def test_a_client_leaving_while_its_request_computes_is_no_server_fault(
    served: Served, path: str
) -> None:
    """The model runs it; the answer has nobody to go to: nothing logged (the module's
    fixture checks the log), and the request counts as completed."""
    base = 1000 + 100 * len(served.calls())
    before = served.counts()
    served.gate.touch()
    try:
        sock = _connect(served)
        sock.sendall(_request(base, path=path))
        wait_until(lambda: base in served.seen(), "the request to reach the model")
        _leave(sock, served)
    finally:
        served.gate.unlink(missing_ok=True)
    wait_until(
        lambda: (
            served.counts()["carpool_requests_completed_total"]
            > before.get("carpool_requests_completed_total", 0.0)
        ),
        "the request to be answered",
    )
    assert _delta(served.counts(), before) == _expected(completed=1, cancelled=0)
    # The server goes on serving.
    sock = _connect(served)
    sock.sendall(_request(base + 1))
    assert _answer_y(sock) == base + 1
    sock.close()


def test_a_cancelled_request_of_a_batch_waiting_on_the_threaded_replica_is_withdrawn(
    served: Served,
) -> None:
    """``executor: thread``: when the replica takes a full batch while another is full,
    the second waits on its thread behind the first; a client of it that leaves is taken
    out when its turn comes, and the rest of it runs."""
    base = 1000 + 100 * len(served.calls())
    before = served.counts()
    first = [base + 1 + i for i in range(MAX_BATCH)]  # held in the model by its own gate
    second = [base + 11 + i for i in range(MAX_BATCH)]  # waits on the thread behind it
    first_gate = Path(f"{served.gate}-{first[0]}")
    first_gate.touch()
    hold = _Hold(served, base)
    try:
        socks = [_connect(served) for _ in first + second]
        # One at a time: connections accepted together may be read in any order.
        for i, (sock, value) in enumerate(zip(socks, first + second, strict=True)):
            sock.sendall(_request(value))
            wait_until(lambda i=i: _pending(served) == i + 1, "the request to queue")
        hold.release()  # the replica takes both full batches at once
        wait_until(lambda: first[0] in served.seen(), "the first batch to reach the model")
        assert _pending(served) == 0  # the second waits on the replica's thread
        _leave(socks[MAX_BATCH + 1], served)
    finally:
        served.gate.unlink(missing_ok=True)
        first_gate.unlink(missing_ok=True)
    for sock, value in zip(socks, first + second, strict=True):
        if value != second[1]:
            assert _answer_y(sock) == value
        sock.close()
    assert second[1] not in served.seen()
    assert [second[0], *second[2:]] in served.calls()
    expected = _expected(completed=1 + 2 * MAX_BATCH - 1, cancelled=1)
    assert _delta(served.counts(), before) == expected


# -- gRPC -------------------------------------------------------------------------------


def _grpc_input(value: int) -> grpcclient.InferInput:
    infer_input = grpcclient.InferInput("X", [1, 1], "INT64")
    infer_input.set_data_from_numpy(np.array([[value]], dtype=np.int64))
    return infer_input


def test_grpc_cancelled_and_timed_out_calls_are_withdrawn(served: Served) -> None:
    base = 1000 + 100 * len(served.calls())
    before = served.counts()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    hold = _Hold(served, base)
    try:
        kept = client.async_infer(
            "rec", [_grpc_input(base + 1)], lambda result, error: answers.put((result, error))
        )
        cancelled = client.async_infer("rec", [_grpc_input(base + 2)], lambda result, error: None)
        wait_until(lambda: _pending(served) == 2, "both calls to queue")
        cancelled.cancel()
        wait_until(lambda: _pending(served) == 1, "the cancelled call to leave the queue")
        with pytest.raises(InferenceServerException) as caught:
            client.infer("rec", [_grpc_input(base + 3)], client_timeout=0.5)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        wait_until(lambda: _pending(served) == 1, "the timed-out call to leave the queue")
        del kept
    finally:
        hold.release()
    result, error = answers.get(timeout=LIMIT_S)
    assert error is None and int(result.as_numpy("Y")[0, 0]) == base + 1
    client.close()
    assert not {base + 2, base + 3} & served.seen()
    assert _delta(served.counts(), before) == _expected(completed=2, cancelled=2)


def test_grpc_stream_cancelled_with_requests_queued_withdraws_them_all(served: Served) -> None:
    base = 1000 + 100 * len(served.calls())
    before = served.counts()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    hold = _Hold(served, base)
    try:
        client.start_stream(callback=lambda result, error: None)
        for i in (1, 2, 3):
            client.async_stream_infer("rec", [_grpc_input(base + i)])
        wait_until(lambda: _pending(served) == 3, "the stream's requests to queue")
        client.stop_stream(cancel_requests=True)
        wait_until(lambda: _pending(served) == 0, "the stream's requests to leave the queue")
    finally:
        hold.release()
        client.close()
    assert not {base + 1, base + 2, base + 3} & served.seen()
    assert _delta(served.counts(), before) == _expected(completed=1, cancelled=3)


# -- the batcher itself: a batch waiting on a busy threaded replica ----------------------


class _GatedModel:
    """A sync model on the replica's thread: records each batch, and blocks a batch whose
    first value has a gate until that gate opens."""

    def __init__(self, *held: int) -> None:
        self.batches: list[list[int]] = []
        self.gates = {value: threading.Event() for value in held}

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        values = [int(v) for v in batch.ravel()]
        self.batches.append(values)
        gate = self.gates.get(values[0])
        if gate is not None:
            gate.wait(LIMIT_S)
        return batch * 10


async def _until(condition: Any, what: str) -> None:
    """Let the loop and the replica thread run until ``condition`` holds."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.to_thread(lambda: None)  # a round trip through another thread
    pytest.fail(f"never happened: {what}")


async def _second_batch_waiting(
    model: _GatedModel, *, tasks: bool
) -> tuple[Batcher, list[Any], list[Any]]:
    """The replica computes [1, 2] (held); the full batch [3, 4] waits on its thread.
    Returns the batcher, the first batch's and the second batch's requests (``submit``
    tasks when ``tasks``, else ``enqueue_many`` requests)."""
    policy = BatchPolicy(max_batch_size=2, max_delay_s=0.0)
    batcher = Batcher(model, policy, executor="thread", collate="numpy")
    await batcher.start()
    blocker = asyncio.ensure_future(batcher.submit(np.array([0]), timeout_s=None))
    await _until(lambda: model.batches == [[0]], "the blocker to reach the model")
    if tasks:
        made: list[Any] = [
            asyncio.ensure_future(batcher.submit(np.array([v]))) for v in (1, 2, 3, 4)
        ]
    else:
        made = [batcher.enqueue_many(np.array([[v]])) for v in (1, 2, 3, 4)]
    await _until(lambda: batcher.num_pending == 4, "both batches to queue")
    model.gates[0].set()  # the replica takes [1, 2] and, full too, [3, 4] behind it
    assert await blocker == 0
    await _until(lambda: len(model.batches) == 2, "the first batch to reach the model")
    assert batcher.num_pending == 0 and model.batches == [[0], [1, 2]]
    return batcher, made[:2], made[2:]


async def test_cancel_withdraws_a_request_of_the_batch_waiting_on_the_thread() -> None:
    model = _GatedModel(0, 1)
    batcher, first, (three, four) = await _second_batch_waiting(model, tasks=False)
    batcher.cancel(three)
    model.gates[1].set()
    assert [(await r.future).tolist() for r in (*first, four)] == [[[10]], [[20]], [[40]]]
    await batcher.stop()
    assert model.batches == [[0], [1, 2], [4]]  # 3 never computed
    snap = batcher.snapshot()
    normal = snap.classes["normal"]
    assert (normal.num_completed, normal.num_failed) == (4, 0)
    assert normal.rejections == {"cancelled": 1}
    assert snap.batches.num_items == 4  # what the model computed


async def test_a_waiting_batch_whose_callers_all_cancel_is_not_run() -> None:
    model = _GatedModel(0, 1)
    batcher, first, second = await _second_batch_waiting(model, tasks=False)
    for request in second:
        batcher.cancel(request)
    model.gates[1].set()
    for request in first:
        await request.future
    await batcher.stop()
    assert model.batches == [[0], [1, 2]]
    snap = batcher.snapshot()
    assert snap.classes["normal"].rejections == {"cancelled": 2}
    assert (snap.batches.num_batches, snap.batches.num_items) == (2, 3)


async def test_a_cancelled_submit_task_of_a_waiting_batch_is_withdrawn() -> None:
    """The task path (ASGI, gRPC, OpenAI): cancelling the awaiting task withdraws too."""
    model = _GatedModel(0, 1)
    batcher, first, (three, four) = await _second_batch_waiting(model, tasks=True)
    three.cancel()
    await asyncio.gather(three, return_exceptions=True)
    model.gates[1].set()
    assert [(await t).tolist() for t in (*first, four)] == [[10], [20], [40]]
    await batcher.stop()
    assert model.batches == [[0], [1, 2], [4]]
    assert batcher.snapshot().classes["normal"].rejections == {"cancelled": 1}


async def test_nobody_cancelling_runs_the_waiting_batch_whole() -> None:
    model = _GatedModel(0, 1)
    batcher, first, second = await _second_batch_waiting(model, tasks=False)
    model.gates[1].set()
    results = [(await r.future).tolist() for r in (*first, *second)]
    assert results == [[[10]], [[20]], [[30]], [[40]]]
    await batcher.stop()
    assert model.batches == [[0], [1, 2], [3, 4]]
    assert batcher.snapshot().classes["normal"].rejections == {}
