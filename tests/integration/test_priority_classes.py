"""Priority classes and deadlines end to end, as a Triton user drives them.

The KServe request parameters ``priority`` (Triton's levels: 1 highest, 0 or beyond the
model's levels = the default) and ``timeout`` (microseconds, 0 = none of its own) reach
carpool's classes through every face: the HTTP fast path (JSON and binary bodies), the
ASGI path (a query string), gRPC unary calls and a gRPC stream. A gated model (it blocks
while a file exists and logs every value it computes) holds the replica busy so that the
queues fill: a class's bound gives 429 with ``Retry-After`` (gRPC UNAVAILABLE, as Triton)
while the other classes are still admitted; an expired ``timeout`` is a 503 / UNAVAILABLE
and never reaches the model; interactive requests queued after background ones are
computed first. A model in steps with ``preempt: true`` answers an interactive request
while a background batch is still in its steps. Under a mixed load from several threads,
every accepted request is
answered exactly once, background ones complete (no class starves), and ``/metrics`` and
``/v2/models/{m}/stats`` count what the clients saw, class by class and reason by reason.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process, wait_until

LIMIT_S = 30.0  # only against hangs
GATED_BATCH = 8  # above the sum of the class bounds: no full batch forms while gated

MODELS = '''\
"""The models of test_classes_review."""

import os
import time


def gated(inputs):
    """Y = X. Logs each call's values to $CR_SEEN, then blocks while $CR_GATE exists."""
    x = inputs["X"]
    with open(os.environ["CR_SEEN"], "a", encoding="utf-8") as seen:
        seen.write(" ".join(str(int(v)) for v in x.ravel()) + "\\n")
    limit = time.monotonic() + 30.0
    while os.path.exists(os.environ["CR_GATE"]) and time.monotonic() < limit:
        time.sleep(0.005)
    return {"Y": x}


def stepped(inputs):
    """Y = X, in steps. Logs each call's values to $CR_SEEN.stepped; a batch holding a
    negative value then takes a step every 5 ms while $CR_GATE exists."""
    x = inputs["X"]
    with open(os.environ["CR_SEEN"] + ".stepped", "a", encoding="utf-8") as seen:
        seen.write(" ".join(str(int(v)) for v in x.ravel()) + "\\n")
    limit = time.monotonic() + 30.0
    while x.min() < 0 and os.path.exists(os.environ["CR_GATE"]) and time.monotonic() < limit:
        yield
        time.sleep(0.005)
    yield
    return {"Y": x}


def slow(inputs):
    """Y = X, 5 ms per batch. Logs each call's values to $CR_SEEN.slow."""
    x = inputs["X"]
    with open(os.environ["CR_SEEN"] + ".slow", "a", encoding="utf-8") as seen:
        seen.write(" ".join(str(int(v)) for v in x.ravel()) + "\\n")
    time.sleep(0.005)
    return {"Y": x}
'''

CONFIG = f"""\
models:
  - name: gated
    kind: python
    source: crmodels:gated
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: {GATED_BATCH}
    max_delay_s: 0.001
    executor: thread
    classes:
      - {{name: interactive, max_queue_size: 2, slo_s: 1.0}}
      - {{name: normal, max_queue_size: 2, max_wait_s: 1.0, slo_s: 2.0}}
      - {{name: background, max_queue_size: 2, share: 0.5, max_wait_s: 5.0, slo_s: 30.0}}
  - name: slow
    kind: python
    source: crmodels:slow
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: 2
    max_delay_s: 0.001
    fill_from_lower: false
    classes:
      - {{name: interactive, max_queue_size: 2, slo_s: 0.05}}
      - {{name: normal, max_queue_size: 4, max_wait_s: 0.2, slo_s: 1.0}}
      - {{name: background, max_queue_size: 4, max_wait_s: 0.2, slo_s: 5.0}}
  - name: stepped
    kind: python
    source: crmodels:stepped
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: 4
    max_delay_s: 0.0
    executor: loop
    preempt: true
"""

CLASSES = ("interactive", "normal", "background")
COUNTED = ("carpool_requests_completed_total", "carpool_pending_requests")


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

    def seen(self, model: str = "gated") -> list[int]:
        """Every value the model computed, in the order it computed them."""
        path = self.seen_file if model == "gated" else Path(f"{self.seen_file}.{model}")
        if not path.exists():
            return []
        return [int(v) for v in path.read_text().split()]

    def counts(self, model: str) -> collections.Counter[tuple[str, str]]:
        """/metrics' counters of ``model`` by (class, name or rejection reason), and
        /stats' success and fail counts under ("stats", ...)."""
        text = httpx.get(f"http://{self.http_url}/metrics", timeout=LIMIT_S).text
        found: collections.Counter[tuple[str, str]] = collections.Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if labels.get("model") != model or "class" not in labels:
                    continue
                if sample.name == "carpool_rejections_total":
                    found[(labels["class"], labels["reason"])] += int(sample.value)
                elif sample.name in COUNTED:
                    found[(labels["class"], sample.name)] += int(sample.value)
        stats = httpx.get(f"http://{self.http_url}/v2/models/{model}/stats", timeout=LIMIT_S)
        inference = stats.json()["model_stats"][0]["inference_stats"]
        found[("stats", "success")] = inference["success"]["count"]
        found[("stats", "fail")] = inference["fail"]["count"]
        return found

    def pending(self, class_name: str) -> int:
        return self.counts("gated")[(class_name, "carpool_pending_requests")]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("classes_review")
    (folder / "crmodels.py").write_text(MODELS, encoding="utf-8")
    seen, gate = folder / "seen.txt", folder / "gate"
    env = {"CR_SEEN": str(seen), "CR_GATE": str(gate)}
    server = Served(start_served_process(CONFIG, folder, grpc=True, env=env), seen, gate)
    try:
        yield server
    finally:
        server.gate.unlink(missing_ok=True)
        assert server.process.stop() == 0, server.process.output()
    output = server.process.output()
    assert "Traceback" not in output and "ERROR" not in output, output


def _delta(
    after: collections.Counter[tuple[str, str]], before: collections.Counter[tuple[str, str]]
) -> dict[tuple[str, str], int]:
    keys = set(after) | set(before)
    changed = {k: after[k] - before[k] for k in keys if "pending" not in k[1]}
    return {k: v for k, v in changed.items() if v}


# -- the faces a request can take ----------------------------------------------------------


def _json_body(value: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [value]}]
    }
    if parameters is not None:
        body["parameters"] = parameters
    return body


@dataclass(frozen=True)
class Answer:
    """What a client saw: ``status`` is the HTTP status, or the gRPC code's name."""

    status: int | str
    message: str
    retry_after: str | None = None


def _http(url: str, model: str, value: int, parameters: dict[str, Any], *, face: str) -> Answer:
    """One request over HTTP: ``json`` (fast path), ``binary`` (fast path, tritonclient's
    binary tensor data, sent raw so the headers can be read) or ``asgi`` (a query string)."""
    path = f"http://{url}/v2/models/{model}/infer"
    if face == "binary":
        document = _json_body(value, parameters)
        document["inputs"][0].pop("data")
        document["inputs"][0]["parameters"] = {"binary_data_size": 8}
        header = httpx.Request("POST", path, json=document).content
        response = httpx.post(
            path,
            content=header + struct.pack("<q", value),
            headers={"Inference-Header-Content-Length": str(len(header))},
            timeout=LIMIT_S,
        )
    else:
        query = {"via": "asgi"} if face == "asgi" else None
        response = httpx.post(
            path, json=_json_body(value, parameters), params=query, timeout=LIMIT_S
        )
    if response.status_code == 200:  # outputs as JSON: none was asked as binary
        got = response.json()["outputs"][0]["data"][0]
        assert got == value, (got, value)
        return Answer(200, "")
    return Answer(
        response.status_code, response.json()["error"], response.headers.get("retry-after")
    )


def _tritonclient_http(url: str, model: str, value: int, **kwargs: Any) -> Answer:
    """One request as tritonclient.http sends it (binary tensor data, ``priority=`` and
    ``timeout=`` arguments); it does not show the answer's headers."""
    client = httpclient.InferenceServerClient(url, network_timeout=LIMIT_S)
    try:
        tensor = httpclient.InferInput("X", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int64))
        result = client.infer(model, [tensor], **kwargs)
        assert int(result.as_numpy("Y")[0, 0]) == value
        return Answer(200, "")
    except InferenceServerException as error:
        return Answer(int(str(error.status())), error.message() or "")
    finally:
        client.close()


def _grpc(url: str, model: str, value: int, **kwargs: Any) -> Answer:
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("X", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int64))
        result = client.infer(model, [tensor], client_timeout=LIMIT_S, **kwargs)
        assert int(result.as_numpy("Y")[0, 0]) == value
        return Answer("OK", "")
    except InferenceServerException as error:
        return Answer(str(error.status()).removeprefix("StatusCode."), error.message() or "")
    finally:
        client.close()


HTTP_FACES = ("json", "binary", "asgi")


class Background:
    """Requests sent on threads; ``join`` gives each one's answer by key."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self._threads: list[threading.Thread] = []

    def send(self, key: str, call: Callable[[], Answer]) -> None:
        def run() -> None:
            self.answers[key] = call()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> dict[str, Answer]:
        for thread in self._threads:
            thread.join(timeout=LIMIT_S)
            assert not thread.is_alive(), "a request was never answered"
        return self.answers


@pytest.fixture
def gate(served: Served) -> Iterator[Path]:
    """The gate closed for one test, and opened again whatever the test did."""
    served.gate.touch()
    yield served.gate
    served.gate.unlink(missing_ok=True)


def _block(served: Served, waiting: Background, value: int) -> None:
    """Send ``value`` and wait until the gated model computes it: the replica is busy."""
    waiting.send("blocker", lambda: _http(served.http_url, "gated", value, {}, face="json"))
    wait_until(lambda: value in served.seen(), f"the model to start on {value}")


# -- the bug: a timeout that is not an integer ---------------------------------------------


@pytest.mark.parametrize("face", HTTP_FACES)
@pytest.mark.parametrize("timeout", [1.5, 250000.0])
def test_a_timeout_that_is_not_an_integer_is_a_400(
    served: Served, face: str, timeout: float
) -> None:
    # Triton's schedule_policy extension: "timeout": an int64 value in microseconds; its
    # HTTP server reads it with MemberAsUInt and refuses anything else (as carpool already
    # did for a priority of 1.5). carpool took 1.5 as a deadline of 1.5 µs: a 503 for a
    # request the client had sent malformed.
    answer = _http(served.http_url, "gated", 7001, {"timeout": timeout}, face=face)
    assert answer.status == 400, answer
    assert "'timeout'" in answer.message and "integer" in answer.message, answer


def test_a_grpc_timeout_that_is_a_double_is_invalid_argument(served: Served) -> None:
    # Triton's gRPC server takes "timeout" as int64_param or uint64_param only.
    request = service_pb2.ModelInferRequest(model_name="gated")
    tensor = request.inputs.add(name="X", datatype="INT64", shape=[1, 1])
    assert tensor.name == "X"
    request.raw_input_contents.append(struct.pack("<q", 7002))
    request.parameters["timeout"].double_param = 5.5
    with grpc.insecure_channel(served.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=LIMIT_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    assert "'timeout'" in str(raised.value.details())


# -- queue bounds, deadlines and order, with the model held busy --------------------------


def test_a_full_class_is_429_with_retry_after_on_every_face_while_others_are_served(
    served: Served, gate: Path
) -> None:
    waiting = Background()
    _block(served, waiting, 100)
    before = served.counts("gated")
    for value in (101, 102):  # background's bound is 2
        waiting.send(
            str(value),
            lambda v=value: _http(served.http_url, "gated", v, {"priority": 3}, face="json"),
        )
    wait_until(lambda: served.pending("background") == 2, "two background requests queued")

    refused = [
        _http(served.http_url, "gated", 110 + i, {"priority": 3}, face=face)
        for i, face in enumerate(HTTP_FACES)
    ]
    for answer in refused:
        assert answer.status == 429 and answer.retry_after == "1", answer
        assert "'background' is full" in answer.message, answer
    grpc_refused = _grpc(served.grpc_url, "gated", 113, priority=3)
    assert grpc_refused.status == "UNAVAILABLE", grpc_refused  # as Triton answers it
    assert "'background' is full" in grpc_refused.message

    # The other classes are still admitted: interactive, and normal (level 0, a level
    # beyond the model's 3, and no priority at all are its default level).
    waiting.send("120", lambda: _grpc(served.grpc_url, "gated", 120, priority=1))
    url = served.http_url
    waiting.send("121", lambda: _http(url, "gated", 121, {"priority": 0}, face="asgi"))
    wait_until(lambda: served.pending("interactive") == 1, "the interactive request queued")
    waiting.send("122", lambda: _tritonclient_http(url, "gated", 122, priority=9))
    wait_until(lambda: served.pending("normal") == 2, "two normal requests queued")
    normal_full = _http(served.http_url, "gated", 123, {}, face="json")
    assert normal_full.status == 429 and "'normal' is full" in normal_full.message

    gate.unlink()
    answers = waiting.join()
    assert {k: a.status for k, a in answers.items()} == {
        "blocker": 200, "101": 200, "102": 200, "120": "OK", "121": 200, "122": 200,
    }  # fmt: skip
    order = served.seen()
    assert order.index(120) < min(order.index(101), order.index(102)), order
    assert _delta(served.counts("gated"), before) == {
        ("background", "queue_full"): 4,
        ("normal", "queue_full"): 1,
        ("background", "carpool_requests_completed_total"): 2,
        ("normal", "carpool_requests_completed_total"): 3,  # with the blocker
        ("interactive", "carpool_requests_completed_total"): 1,
        ("stats", "success"): 6,
        ("stats", "fail"): 5,
    }


def test_an_expired_timeout_is_503_on_every_face_and_never_reaches_the_model(
    served: Served, gate: Path
) -> None:
    waiting = Background()
    _block(served, waiting, 200)
    before = served.counts("gated")
    timeout_us = 200_000  # Triton's unit: microseconds
    answers = [
        _http(served.http_url, "gated", 201 + i, {"priority": 1, "timeout": timeout_us}, face=f)
        for i, f in enumerate(HTTP_FACES)
    ]
    for answer in answers:
        assert answer.status == 503 and answer.retry_after is None, answer
        assert "past its timeout of 200.0 ms" in answer.message, answer
    expired = _grpc(served.grpc_url, "gated", 204, priority=1, timeout=timeout_us)
    assert expired.status == "UNAVAILABLE", expired  # as Triton's "Request timeout expired"
    assert "past its timeout of 200.0 ms" in expired.message

    # timeout 0 is none of its own (the class has none): it waits for the gate.
    waiting.send("205", lambda: _grpc(served.grpc_url, "gated", 205, priority=1, timeout=0))
    wait_until(lambda: served.pending("interactive") == 1, "the timeout-0 request queued")
    gate.unlink()
    assert {k: a.status for k, a in waiting.join().items()} == {"blocker": 200, "205": "OK"}
    assert not {201, 202, 203, 204} & set(served.seen()), served.seen()
    assert _delta(served.counts("gated"), before) == {
        ("interactive", "deadline"): 4,
        ("interactive", "carpool_requests_completed_total"): 1,
        ("normal", "carpool_requests_completed_total"): 1,  # the blocker
        ("stats", "success"): 2,
        ("stats", "fail"): 4,
    }


def test_a_stream_carries_each_requests_priority(served: Served, gate: Path) -> None:
    waiting = Background()
    _block(served, waiting, 300)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sent = [(301, 3), (302, 3), (303, 3), (311, 1), (312, 0)]
        for value, level in sent:
            tensor = grpcclient.InferInput("X", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int64))
            client.async_stream_infer("gated", [tensor], request_id=str(value), priority=level)
        wait_until(
            lambda: served.pending("background") == 2 and served.pending("normal") == 1,
            "the stream's requests queued by class",
        )
        gate.unlink()
        got = [answers.get(timeout=LIMIT_S) for _ in sent]
    finally:
        client.stop_stream()
        client.close()
    waiting.join()
    # Answered in the order sent (a stream of a model that is not decoupled, as Triton);
    # the third background request found its class full.
    outcomes = [
        (result.get_response().id, None) if error is None else (None, error.message())
        for result, error in got
    ]
    assert [o[0] for o in outcomes] == ["301", "302", None, "311", "312"], outcomes
    assert "'background' is full" in str(outcomes[2][1])
    order = served.seen()
    assert order.index(311) < order.index(312) < min(order.index(301), order.index(302)), order


# -- a sustained mixed load ---------------------------------------------------------------

LOAD_WORKERS = (  # (face, priority level): interactive outnumbers the bound it has
    ("binary", 1), ("asgi", 1), ("grpc", 1), ("tritonclient", 1),
    ("json", 2), ("tritonclient", 3), ("grpc", 3),
)  # fmt: skip
ENOUGH = 5  # completions per class that show no class starved


def test_mixed_load_is_answered_once_per_request_and_counted_by_class(served: Served) -> None:
    before = served.counts("slow")
    seen_before = collections.Counter(served.seen("slow"))
    lock = threading.Lock()
    seen_by_client: collections.Counter[tuple[str, str]] = collections.Counter()
    answered: collections.Counter[int] = collections.Counter()
    stop = threading.Event()
    failures: list[str] = []

    def work(worker: int, face: str, level: int) -> None:
        name = CLASSES[level - 1]
        for i in range(1, 100_000):
            if stop.is_set():
                return
            value = 1_000_000 * (worker + 1) + i
            timeout = 1_000 if level == 1 and i % 4 == 0 else None  # 1 ms: some expire
            if face == "grpc":
                answer = _grpc(served.grpc_url, "slow", value, priority=level, timeout=timeout)
            elif face == "tritonclient":
                answer = _tritonclient_http(
                    served.http_url, "slow", value, priority=level, timeout=timeout
                )
            else:
                parameters: dict[str, Any] = {"priority": level}
                if timeout is not None:
                    parameters["timeout"] = timeout
                answer = _http(served.http_url, "slow", value, parameters, face=face)
            if answer.status in (200, "OK"):
                outcome = "ok"
            elif answer.status in (429, "UNAVAILABLE") and "is full" in answer.message:
                outcome = "queue_full"
                if face in HTTP_FACES and answer.retry_after != "1":
                    failures.append(f"429 without Retry-After: {answer}")
            elif answer.status in (503, "UNAVAILABLE") and "past its timeout" in answer.message:
                outcome = "deadline"
            else:
                failures.append(f"{face} {name} {value}: {answer}")
                continue
            with lock:
                seen_by_client[(name, outcome)] += 1
                if outcome == "ok":
                    answered[value] += 1

    def enough() -> bool:
        with lock:
            return all(seen_by_client[(name, "ok")] >= ENOUGH for name in CLASSES)

    threads = [
        threading.Thread(target=work, args=(i, face, level), daemon=True)
        for i, (face, level) in enumerate(LOAD_WORKERS)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_until(enough, f"{ENOUGH} answers in every class under load (no starvation)")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=LIMIT_S)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]

    computed = collections.Counter(served.seen("slow")) - seen_before
    assert set(computed) == set(answered), "the model computed exactly what was answered"
    assert max(computed.values()) == 1 and max(answered.values()) == 1
    expected: dict[tuple[str, str], int] = {}
    for (name, outcome), count in seen_by_client.items():
        key = "carpool_requests_completed_total" if outcome == "ok" else outcome
        expected[(name, key)] = count
    expected[("stats", "success")] = sum(answered.values())
    expected[("stats", "fail")] = sum(
        n for (_, outcome), n in seen_by_client.items() if outcome != "ok"
    )
    assert _delta(served.counts("slow"), before) == expected


def test_an_interactive_request_runs_between_the_steps_of_a_background_batch(
    served: Served,
) -> None:
    """``preempt: true`` on a model in steps on the event loop: while a background batch
    takes its steps (held by the gate), an interactive request is answered; the
    background one only once the gate opens."""
    served.gate.touch()
    answers: queue.Queue[Answer] = queue.Queue()
    background = threading.Thread(
        target=lambda: answers.put(
            _http(served.http_url, "stepped", -7, {"priority": 3}, face="json")
        )
    )
    background.start()
    try:
        wait_until(lambda: -7 in served.seen("stepped"), "the background batch to start")
        interactive = _http(served.http_url, "stepped", 5, {"priority": 1}, face="json")
        assert interactive.status == 200, interactive
        assert background.is_alive() and answers.empty()  # still in its steps
        assert served.seen("stepped") == [-7, 5]
    finally:
        served.gate.unlink(missing_ok=True)
        background.join(LIMIT_S)
    assert answers.get_nowait().status == 200
