"""Faults the campaign of issue 22 keeps, on real servers, that other modules do not cover
already: thousands of clients that hang up mid-request, a model that leaks memory on
every call, and SIGTERM under load followed at once by a restart on the same ports.

Covered elsewhere: a model that raises on one input (test_fault_mix, with every wire),
SIGTERM under load (test_server_robustness, test_fault_mix, test_connection_abuse) and a
restart after the server closed an idle connection (test_server_robustness).

``CARPOOL_FAULT_DISCONNECTS`` sets how many clients hang up (10,000 by default).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, free_port, rss_kb, start_served_process, wait_until

LIMIT_S = 60.0  # a net against a hang, never a timing assertion
NUM_DISCONNECTS = int(os.environ.get("CARPOOL_FAULT_DISCONNECTS", "10000"))
MAX_RSS_GROWTH_KIB = 50 * 1024
CONCURRENT_CLIENTS = 200

CONFIG = """\
models:
  - name: slow
    kind: python
    source: configmodels:slow_double
    inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]
    max_batch_size: 8
    max_delay_s: 0.001
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{name: INPUT0, datatype: FP32, shape: [-1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [-1]}]
    max_batch_size: 16
    max_delay_s: 0.001
  - name: leaky
    kind: python
    source: configmodels:leaky
    inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
    outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]
    max_batch_size: 1
    max_delay_s: 0
  - name: probe
    kind: python
    source: configmodels:server_probe
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: N, datatype: INT64, shape: [3]}]
    max_batch_size: 4
    max_delay_s: 0.001
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    process = start_served_process(CONFIG, tmp_path_factory.mktemp("faults"), grpc=True)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


def _infer(http_url: str, model: str, values: list[float], client: Any = httpx) -> list[float]:
    """``model``'s OUTPUT0 for INPUT0 = ``values`` (one row each), over ``client``."""
    body = {"inputs": [{"name": "INPUT0", "shape": [len(values), 1], "datatype": "FP32"}]}
    body["inputs"][0]["data"] = values
    response = client.post(f"http://{http_url}/v2/models/{model}/infer", json=body, timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    return [float(v) for v in response.json()["outputs"][0]["data"]]


def _probe(http_url: str) -> tuple[int, int, int]:
    """The server's (asyncio tasks, threads, open descriptors), from the probe model."""
    body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [0]}]}
    response = httpx.post(f"http://{http_url}/v2/models/probe/infer", json=body, timeout=LIMIT_S)
    assert response.status_code == 200, response.text
    tasks, threads, fds = response.json()["outputs"][0]["data"]
    return int(tasks), int(threads), int(fds)


def _counters(http_url: str, model: str) -> dict[str, float]:
    """The model's request counters and queue from /metrics (rejections by reason)."""
    text = httpx.get(f"http://{http_url}/metrics", timeout=LIMIT_S).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model or sample.name.endswith("_created"):
                continue
            key = sample.name
            if "reason" in sample.labels:
                key += ":" + sample.labels["reason"]
            found[key] = found.get(key, 0.0) + sample.value
    return found


def _settled(http_url: str, model: str) -> bool:
    """Nothing queued, and every request accepted ended exactly one way: answered,
    failed, cancelled, past its deadline or refused while closing."""
    c = _counters(http_url, model)
    ended = c.get("carpool_requests_completed_total", 0) + c.get("carpool_requests_failed_total", 0)
    ended += sum(
        c.get(f"carpool_rejections_total:{r}", 0) for r in ("cancelled", "deadline", "closed")
    )
    return c.get("carpool_pending_requests", 0) == 0 and c["carpool_requests_total"] == ended


# -- thousands of clients that hang up --------------------------------------------------

_BODY = orjson.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
)
_REQUEST = (
    f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: faults\r\nContent-Type: application/json\r\n"
    f"Content-Length: {len(_BODY)}\r\n\r\n"
).encode() + _BODY
_HEAD_END = _REQUEST.index(b"\r\n\r\n") + 4
HANG_UPS = {
    "in the head": _REQUEST[: _HEAD_END // 2],
    "in the body": _REQUEST[: _HEAD_END + len(_BODY) // 2],
    "after the request": _REQUEST,
    "after two pipelined": _REQUEST * 2,
}


async def _hang_up(host: str, port: int, data: bytes, reset: bool) -> None:
    """Connect, write ``data``, and go: with a FIN, or with a reset (SO_LINGER 0)."""
    _, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    await writer.wait_closed()


async def _hang_ups(host: str, port: int, count: int) -> None:
    kinds = list(HANG_UPS.values())
    gate = asyncio.Semaphore(CONCURRENT_CLIENTS)

    async def one(i: int) -> None:
        async with gate:
            await _hang_up(host, port, kinds[i % len(kinds)], reset=(i // len(kinds)) % 2 == 1)

    await asyncio.gather(*(one(i) for i in range(count)))


def test_thousands_of_clients_hanging_up_mid_request_leave_nothing_behind(
    served: ServedProcess,
) -> None:
    """Each of NUM_DISCONNECTS clients goes (FIN or reset) in the head, in the body, after
    the request or after two pipelined: then nothing is queued, every accepted request
    ended exactly once, no task, thread or descriptor is left, memory is back within
    50 MiB, and the next request is answered right."""
    host, port = served.http_url.split(":")
    asyncio.run(_hang_ups(host, int(port), 200))  # warm: plans, the executor's threads
    wait_until(lambda: _settled(served.http_url, "slow"), "the warm-up to settle")
    tasks, threads, fds = before = _probe(served.http_url)
    rss_before = rss_kb(served.process.pid)
    asyncio.run(_hang_ups(host, int(port), NUM_DISCONNECTS))
    wait_until(lambda: _settled(served.http_url, "slow"), "every accepted request to end")
    after: list[tuple[int, int, int]] = []

    def released() -> bool:
        after.append(_probe(served.http_url))
        return after[-1][0] <= tasks and after[-1][1] <= threads and after[-1][2] <= fds

    wait_until(released, f"(tasks, threads, descriptors) {before} to come back from {after[-1:]}")
    assert rss_kb(served.process.pid) - rss_before <= MAX_RSS_GROWTH_KIB
    assert _infer(served.http_url, "slow", [21.0]) == [42.0]


# -- a model that leaks ------------------------------------------------------------------


def test_a_model_leaking_on_every_call_shows_in_rss_and_the_others_are_served(
    served: ServedProcess,
) -> None:
    """The leak is the model's: the server's resident memory shows it (as soak.py and the
    fuzz modules read it), and the other models and readiness carry on meanwhile."""
    from .configmodels import LEAK_BYTES

    calls = 200
    before = rss_kb(served.process.pid)
    with ThreadPoolExecutor(max_workers=4) as pool, httpx.Client() as client:
        leaks = [
            pool.submit(_infer, served.http_url, "leaky", [float(i)], client) for i in range(calls)
        ]
        for i in range(50):
            assert _infer(served.http_url, "doubler", [i, -i], client) == [2.0 * i, -2.0 * i]
        assert [job.result(timeout=LIMIT_S) for job in leaks] == [[2.0 * i] for i in range(calls)]
    grown_kib = rss_kb(served.process.pid) - before
    assert grown_kib >= 0.8 * calls * LEAK_BYTES / 1024, f"RSS grew only {grown_kib} KiB"
    ready = httpx.get(f"http://{served.http_url}/v2/health/ready", timeout=LIMIT_S)
    assert ready.status_code == 200


# -- SIGTERM under load, then a restart at once ------------------------------------------


def _http_load(http_url: str, stop: threading.Event) -> dict[str, Any]:
    """Requests on keep-alive connections until ``stop``: outcomes counted; a request
    answered with a wrong value, or any status but 200 and the draining 503, counts as
    "wrong" (and is kept under "examples")."""
    seen: dict[str, Any] = {"ok": 0, "draining": 0, "refused": 0, "closed": 0, "wrong": 0}
    with httpx.Client(timeout=LIMIT_S) as client:
        i = 0
        while not stop.is_set():
            i += 1
            body = {
                "inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [i, 1]}]
            }
            try:
                response = client.post(f"http://{http_url}/v2/models/doubler/infer", json=body)
            except httpx.ConnectError:  # the listener is closed: not accepted
                seen["refused"] += 1
                stop.wait(0.01)
                continue
            except httpx.TransportError:  # a keep-alive connection closed as the request
                seen["closed"] += 1  # went: the race every HTTP/1.1 server has at a stop
                continue
            if response.status_code == 503:
                seen["draining"] += 1
            elif response.status_code == 200 and response.json()["outputs"][0]["data"] == [
                2 * i,
                2,
            ]:
                seen["ok"] += 1
            else:
                seen["wrong"] += 1
                seen.setdefault("examples", []).append(f"{response.status_code} {response.text}")
    return seen


# A call refused as the server stops: UNAVAILABLE once its port is closed, or CANCELLED
# for one that reached grpcio just as its server began to stop (a bare grpc.aio server
# does the same); carpool never started either.
GRPC_REFUSALS = {"StatusCode.UNAVAILABLE": "unavailable", "StatusCode.CANCELLED": "cancelled"}


def _grpc_load(grpc_url: str, stop: threading.Event) -> dict[str, Any]:
    """gRPC requests until ``stop``, counted as _http_load counts them."""
    seen: dict[str, Any] = {"ok": 0, "unavailable": 0, "cancelled": 0, "wrong": 0}
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        i = 0
        while not stop.is_set():
            i += 1
            tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[i]], dtype=np.float32))
            try:
                answer = client.infer("doubler", [tensor], client_timeout=LIMIT_S)
            except InferenceServerException as error:
                kind = GRPC_REFUSALS.get(str(error.status()), "wrong")
                seen[kind] += 1
                if kind == "wrong":
                    seen.setdefault("examples", []).append(f"{error.status()} {error.message()}")
                stop.wait(0.01)
                continue
            seen["ok" if answer.as_numpy("OUTPUT0").tolist() == [[2.0 * i]] else "wrong"] += 1
    finally:
        client.close()
    return seen


def test_sigterm_under_load_then_a_restart_on_the_same_ports_serves_at_once(
    tmp_path: Path,
) -> None:
    """Sixteen HTTP and four gRPC clients keep sending while the server gets SIGTERM: it
    exits 0, and every answer was right or a refusal (the draining 503, a closed port or
    keep-alive connection, UNAVAILABLE, grpcio's CANCELLED of a call it had not handed
    over yet). A server started at once on the same ports (left with many connections
    the server closed) is ready and answers; the clients carry on against it."""
    ports = (free_port(), free_port())
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = start_served_process(CONFIG, tmp_path / "first", grpc=True, ports=ports)
    assert first.grpc_url is not None
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=20)
    try:
        jobs: list[Any] = [pool.submit(_http_load, first.http_url, stop) for _ in range(16)]
        jobs += [pool.submit(_grpc_load, first.grpc_url, stop) for _ in range(4)]
        wait_until(lambda: _counters(first.http_url, "doubler")["carpool_requests_total"] > 200,
                   "the load to get going")  # fmt: skip
        first.process.send_signal(signal.SIGTERM)
        first.stopped = True
        assert first.process.wait(timeout=LIMIT_S) == 0, first.output()
        second = start_served_process(CONFIG, tmp_path / "second", grpc=True, ports=ports)
        try:
            assert _infer(second.http_url, "doubler", [3.0]) == [6.0]
            before = _counters(second.http_url, "doubler")["carpool_requests_total"]
            wait_until(
                lambda: (
                    _counters(second.http_url, "doubler")["carpool_requests_total"] > before + 100
                ),
                "the clients to carry on against the new server",
            )
            stop.set()
            outcomes = [job.result(timeout=LIMIT_S) for job in jobs]
        finally:
            stop.set()
            assert second.stop() == 0, second.output()
    finally:  # whatever failed, the clients stop and the first server is gone
        stop.set()
        pool.shutdown(wait=True)
        if first.process.poll() is None:
            first.process.kill()
            first.process.wait()
    assert all(seen["wrong"] == 0 for seen in outcomes), outcomes
    assert all(seen["ok"] > 0 for seen in outcomes), outcomes
    assert "Traceback" not in first.output() + second.output()
