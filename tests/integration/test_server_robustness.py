"""`carpool serve` under stress: every datatype over every wire, SIGTERM under load,
deadlines, bad requests mixed with good ones, and a gRPC client that gives up."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, StartServer, start_served_process, wait_until

WAIT_LIMIT_S = 30.0
DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]


def _tensor_config(prefix: str, datatypes: list[str]) -> str:
    return ", ".join(f"{{name: {prefix}_{d}, datatype: {d}, shape: [3]}}" for d in datatypes)


CONFIG = f"""\
models:
  - name: identity
    kind: python
    source: configmodels:identity
    inputs: [{_tensor_config("IN", DATATYPES)}]
    outputs: [{_tensor_config("OUT", DATATYPES)}]
    max_batch_size: 8
    max_delay_s: 0.001
  - name: identity_bf16
    kind: python
    source: configmodels:identity
    inputs: [{_tensor_config("IN", ["BF16"])}]
    outputs: [{_tensor_config("OUT", ["BF16"])}]
  - name: doubler
    kind: python
    source: configmodels:double
    inputs: [{{name: INPUT0, datatype: FP32, shape: [-1]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [-1]}}]
    max_batch_size: 16
    max_delay_s: 0.002
  - name: slow
    kind: python
    source: configmodels:slow_double
    inputs: [{{name: INPUT0, datatype: FP32, shape: [1]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [1]}}]
    max_batch_size: 8
    max_delay_s: 0.001
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{{name: X, datatype: INT64, shape: [1]}}]
    outputs: [{{name: Y, datatype: INT64, shape: [1]}}]
    max_batch_size: 4
    max_delay_s: 0.001
"""


class Served:
    """The module's server plus the gated model's files."""

    def __init__(self, process: ServedProcess, seen: Path, gate: Path) -> None:
        self.process = process
        self.http_url = process.http_url
        assert process.grpc_url is not None
        self.grpc_url = process.grpc_url
        self.seen = seen
        self.gate = gate

    def seen_values(self) -> list[int]:
        if not self.seen.exists():
            return []
        return [int(line) for line in self.seen.read_text().split()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("robustness")
    seen, gate = folder / "seen.txt", folder / "gate"
    env = {"CARPOOL_TEST_SEEN": str(seen), "CARPOOL_TEST_GATE": str(gate)}
    process = start_served_process(CONFIG, folder, grpc=True, env=env)
    try:
        yield Served(process, seen, gate)
    finally:
        gate.unlink(missing_ok=True)
        assert process.stop() == 0, process.output()
    assert "Traceback" not in process.output()


# -- 1. every datatype, end to end -----------------------------------------------------


def _values(datatype: str) -> np.ndarray:
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if datatype == "BYTES":
        return np.array([[b"abc", b"", b"x y"], [b"\xce\xbb", b"0", b"long" * 10]], dtype=object)
    if datatype.startswith("FP"):
        dtype = np.dtype(f"float{datatype[2:]}")
        return np.array([[0.5, -1.25, 3000.0], [0.0, -0.0, 65504.0]], dtype=dtype)
    dtype = np.dtype(datatype.lower())
    info = np.iinfo(dtype)
    return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=dtype)


def _normalise(datatype: str, array: np.ndarray) -> np.ndarray:
    if datatype != "BYTES":
        return array
    flat = [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel()]
    return np.array(flat, dtype=object).reshape(array.shape)


def _check_round_trip(datatype: str, got: np.ndarray) -> None:
    want = _values(datatype)
    got = _normalise(datatype, got)
    assert got.shape == want.shape, datatype
    if datatype == "BYTES":
        assert got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype, datatype
        np.testing.assert_array_equal(got, want, err_msg=datatype)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_datatype_round_trips_over_http(served: Served, binary: bool) -> None:
    inputs, outputs = [], []
    for datatype in DATATYPES:
        values = _values(datatype)
        infer_input = httpclient.InferInput(f"IN_{datatype}", list(values.shape), datatype)
        infer_input.set_data_from_numpy(values, binary_data=binary)
        inputs.append(infer_input)
        outputs.append(httpclient.InferRequestedOutput(f"OUT_{datatype}", binary_data=binary))
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        result = client.infer("identity", inputs, outputs=outputs)
    finally:
        client.close()
    for datatype in DATATYPES:
        _check_round_trip(datatype, result.as_numpy(f"OUT_{datatype}"))


def test_every_datatype_round_trips_over_grpc(served: Served) -> None:
    inputs = []
    for datatype in DATATYPES:
        values = _values(datatype)
        infer_input = grpcclient.InferInput(f"IN_{datatype}", list(values.shape), datatype)
        infer_input.set_data_from_numpy(values)
        inputs.append(infer_input)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        result = client.infer("identity", inputs)
    finally:
        client.close()
    for datatype in DATATYPES:
        _check_round_trip(datatype, result.as_numpy(f"OUT_{datatype}"))


def test_bf16_round_trips_over_binary_http(served: Served) -> None:
    values = np.array([[1.5, -2.0, 0.125], [3.0, 0.0, -256.0]], dtype=np.float32)  # exact in bf16
    infer_input = httpclient.InferInput("IN_BF16", list(values.shape), "BF16")
    infer_input.set_data_from_numpy(values, binary_data=True)
    output = httpclient.InferRequestedOutput("OUT_BF16", binary_data=True)
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        result = client.infer("identity_bf16", [infer_input], outputs=[output])
    finally:
        client.close()
    got = result.as_numpy("OUT_BF16")
    np.testing.assert_array_equal(got.astype(np.float32), values)


# -- helpers for the gated model ----------------------------------------------------------


def _infer_gated(http_url: str, value: int, parameters: dict[str, Any] | None = None) -> Any:
    body: dict[str, Any] = {
        "inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [value]}]
    }
    if parameters:
        body["parameters"] = parameters
    return httpx.post(f"http://{http_url}/v2/models/gated/infer", json=body, timeout=60.0)


def _gated_y(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["outputs"][0]["data"][0])


def _rejections(http_url: str, model: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{http_url}/metrics", timeout=10.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_rejections_total"
        and sample.labels.get("model") == model
        and sample.labels.get("reason") == reason
    )


# -- 3. a deadline shorter than the wait is a 503 -----------------------------------------


def test_deadline_shorter_than_the_wait_is_a_503_and_others_succeed(served: Served) -> None:
    served.gate.touch()
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            blocker = pool.submit(_infer_gated, served.http_url, 4004)
            wait_until(lambda: 4004 in served.seen_values(), "the blocker to reach the model")
            patient = pool.submit(_infer_gated, served.http_url, 6006)
            hasty = _infer_gated(served.http_url, 5005, {"timeout": 50_000})  # 50 ms in µs
        finally:
            served.gate.unlink(missing_ok=True)
        assert hasty.status_code == 503, hasty.text
        assert "timeout" in hasty.json()["error"]
        assert _gated_y(blocker.result(timeout=60)) == 4004
        assert _gated_y(patient.result(timeout=60)) == 6006
    assert 5005 not in served.seen_values()


# -- 5. a gRPC client that gives up has its queued request dropped ------------------------


def test_grpc_client_giving_up_drops_its_queued_request(served: Served) -> None:
    before = _rejections(served.http_url, "gated", "cancelled")
    served.gate.touch()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            blocker = pool.submit(_infer_gated, served.http_url, 1001)
            wait_until(lambda: 1001 in served.seen_values(), "the blocker to reach the model")
            infer_input = grpcclient.InferInput("X", [1, 1], "INT64")
            infer_input.set_data_from_numpy(np.array([[2002]], dtype=np.int64))
            with pytest.raises(InferenceServerException) as caught:
                client.infer("gated", [infer_input], client_timeout=0.3)
            assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
            wait_until(
                lambda: _rejections(served.http_url, "gated", "cancelled") > before,
                "the server to count the cancelled request",
            )
        finally:
            served.gate.unlink(missing_ok=True)
            client.close()
        assert _gated_y(blocker.result(timeout=60)) == 1001
    assert _gated_y(_infer_gated(served.http_url, 3003)) == 3003
    seen = served.seen_values()
    assert 3003 in seen
    assert 2002 not in seen


# -- 4. bad requests do not harm the good ones beside them --------------------------------


def _post(http_url: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"http://{http_url}/v2/models/doubler/infer", content=content, headers=headers, timeout=60
    )


def _good(http_url: str, i: int) -> tuple[str, httpx.Response]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [i, -i]}]}
    return "good", _post(http_url, orjson.dumps(body))


def _bad(http_url: str, kind: str) -> tuple[str, httpx.Response]:
    tensor: dict[str, Any] = {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32"}
    if kind == "shape":
        tensor.update(shape=[1, 2, 2], data=[1, 2, 3, 4])
    elif kind == "datatype":
        tensor.update(datatype="FP64", data=[1, 2])
    elif kind == "missing":
        return kind, _post(http_url, orjson.dumps({"inputs": []}))
    elif kind == "byte_size":  # 12 bytes declared and sent where [1, 2] FP32 needs 8
        tensor["parameters"] = {"binary_data_size": 12}
        header = orjson.dumps({"inputs": [tensor]})
        data = np.zeros(3, dtype="<f4").tobytes()
        headers = {"Inference-Header-Content-Length": str(len(header))}
        return kind, _post(http_url, header + data, headers)
    elif kind == "short_body":  # the declared size is right but the bytes are not there
        tensor["parameters"] = {"binary_data_size": 8}
        header = orjson.dumps({"inputs": [tensor]})
        headers = {"Inference-Header-Content-Length": str(len(header))}
        return kind, _post(http_url, header + b"\0\0\0\0", headers)
    return kind, _post(http_url, orjson.dumps({"inputs": [tensor]}))


BAD_MESSAGES = {
    "shape": ["'INPUT0'", "shape [1, 2, 2]"],
    "datatype": ["'INPUT0'", "datatype FP64"],
    "missing": ["missing input 'INPUT0'"],
    "byte_size": ["'INPUT0'", "binary_data_size is 12 bytes"],
    "short_body": ["binary_data_size", "8 bytes", "4 bytes"],
}


def test_bad_requests_get_400s_and_good_ones_beside_them_succeed(served: Served) -> None:
    jobs: list[Future[tuple[str, httpx.Response]]] = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        for round_ in range(6):
            for i in range(8):
                jobs.append(pool.submit(_good, served.http_url, 10 * round_ + i))
            for kind in BAD_MESSAGES:
                jobs.append(pool.submit(_bad, served.http_url, kind))
        outcomes = [job.result(timeout=60) for job in jobs]
    good_values = []
    for kind, response in outcomes:
        if kind == "good":
            assert response.status_code == 200, response.text
            output = response.json()["outputs"][0]
            good_values.append(output["data"])
        else:
            assert response.status_code == 400, (kind, response.text)
            message = response.json()["error"]
            for fragment in BAD_MESSAGES[kind]:
                assert fragment in message, (kind, message)
    expected = [[2.0 * v, -2.0 * v] for r in range(6) for v in range(10 * r, 10 * r + 8)]
    assert good_values == expected


# -- 2. SIGTERM under load loses nothing ---------------------------------------------------

NUM_LOAD_REQUESTS = 200


def _slow_request(http_url: str, i: int, answered: threading.Event) -> tuple[str, Any]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [i]}]}
    try:
        response = httpx.post(
            f"http://{http_url}/v2/models/slow/infer", content=orjson.dumps(body), timeout=60.0
        )
    except httpx.TransportError as error:  # refused: arrived after shutdown began
        return "refused", repr(error)
    if response.status_code == 200:
        answered.set()
        return "ok", response.json()["outputs"][0]["data"][0]
    return f"status {response.status_code}", response.text


def test_sigterm_under_load_answers_every_accepted_request(start_server: StartServer) -> None:
    server = start_server(CONFIG)
    answered = threading.Event()
    with ThreadPoolExecutor(max_workers=48) as pool:
        jobs = [
            pool.submit(_slow_request, server.http_url, i, answered)
            for i in range(NUM_LOAD_REQUESTS)
        ]
        assert answered.wait(timeout=WAIT_LIMIT_S), server.output()
        server.process.send_signal(signal.SIGTERM)
        server.stopped = True
        outcomes = [job.result(timeout=90) for job in jobs]
    assert server.process.wait(timeout=60) == 0, server.output()
    ok = refused = draining = 0
    for i, (kind, detail) in enumerate(outcomes):
        if kind == "ok":
            assert detail == 2.0 * i
            ok += 1
        elif kind == "refused":
            refused += 1
        else:  # a response: only a 503 from the draining server is acceptable
            assert kind == "status 503", (i, kind, detail)
            draining += 1
    assert ok >= 1
    assert ok + refused + draining == NUM_LOAD_REQUESTS
    assert "Traceback" not in server.output()


def test_a_restart_on_the_same_ports_works_after_the_server_closed_connections(
    tmp_path: Path,
) -> None:
    """Was: "Address already in use" (exit 3) for 60 s after any connection the server
    closed first: its TIME_WAIT, inherited from a listener bound without SO_REUSEADDR,
    blocked the next bind of the port. HTTP and gRPC."""
    from .conftest import DOUBLER_CONFIG, free_port

    ports = (free_port(), free_port())
    first = start_served_process(DOUBLER_CONFIG, tmp_path, grpc=True, ports=ports)
    host, port = first.http_url.split(":")
    idle = socket.create_connection((host, int(port)), timeout=WAIT_LIMIT_S)
    idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert idle.recv(1024).startswith(b"HTTP/1.1 200")
    assert first.stop() == 0, first.output()  # the server closes the idle connection
    assert idle.recv(1024) == b""
    idle.close()
    second = start_served_process(DOUBLER_CONFIG, tmp_path, grpc=True, ports=ports)
    try:
        assert second.http_url == first.http_url
        answer = httpx.get(f"http://{second.http_url}/v2/health/ready", timeout=WAIT_LIMIT_S)
        assert answer.status_code == 200
    finally:
        assert second.stop() == 0, second.output()
