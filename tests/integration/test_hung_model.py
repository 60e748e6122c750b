"""A model that hangs on one input, served by a real `carpool serve`: its batch fails with
504 / DEADLINE_EXCEEDED after ``batch_timeout_s``, the replica is replaced (readiness 503
until its model is built again), other models and later requests are served, and a
SIGTERM while a request is stuck exits within ``--drain-timeout-s`` with status 1."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import DOUBLER_CONFIG, ServedProcess, StartServer, wait_until

MODEL = """\
  - name: {name}
    kind: python
    source: configmodels:hangs_on_negative
    inputs: [{{name: INPUT0, datatype: FP32, shape: [-1]}}]
    outputs: [{{name: OUTPUT0, datatype: FP32, shape: [-1]}}]
    max_batch_size: 4
    max_delay_s: 5.0          # a batch closes when 4 requests fill it
    executor: thread
    batch_timeout_s: {batch_timeout_s}
"""
BATCH = (1.0, -1.0, 3.0, 4.0)  # four requests: one batch, hung by its negative one
EXIT_LIMIT_S = 30.0  # a net far below the model's hang (120 s), not a timing assertion


def _infer_http(url: str, model: str, value: float) -> httpx.Response:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    return httpx.post(f"http://{url}/v2/models/{model}/infer", json=body, timeout=60)


def _batch_http(url: str, values: tuple[float, ...]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(lambda v: _infer_http(url, "hanger", v), values))


def _infer_grpc(client: grpcclient.InferenceServerClient, value: float) -> object:
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    try:
        return client.infer("hanger", [tensor], client_timeout=60).as_numpy("OUTPUT0")
    except InferenceServerException as error:
        return error


def _status(url: str, path: str) -> int:
    return httpx.get(f"http://{url}{path}", timeout=10).status_code


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"http://{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{model="hanger"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for hanger in /metrics")


def test_a_hung_batch_fails_alone_and_its_replica_is_replaced(
    start_server: StartServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    config = DOUBLER_CONFIG + MODEL.format(name="hanger", batch_timeout_s=1.0)
    server = start_server(config, grpc=True, env={"CARPOOL_TEST_GATE": str(gate)})
    assert server.grpc_url is not None
    url = server.http_url
    gate.touch()  # builds after the first wait for it: the rebuild can be watched
    with ThreadPoolExecutor(1) as pool:
        hung = pool.submit(_batch_http, url, BATCH)
        # Meanwhile another model answers, over both wires.
        for value in (1.0, 2.0, 3.0):
            response = _infer_http(url, "doubler", value)
            assert response.json()["outputs"][0]["data"] == [2 * value]
        with httpclient.InferenceServerClient(url) as client:
            assert client.is_model_ready("doubler")
        answers = hung.result(timeout=60)

    assert [r.status_code for r in answers] == [504] * 4, [r.text for r in answers]
    assert "batch_timeout_s=1 s" in answers[1].json()["error"]
    # Its only replica waits for its model to be built again: not ready; the rest is.
    assert _status(url, "/v2/health/ready") == 503
    assert _status(url, "/v2/models/hanger/ready") == 503
    assert _status(url, "/v2/models/doubler/ready") == 200
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert not grpc.is_server_ready()
        assert not grpc.is_model_ready("hanger")
        assert grpc.is_model_ready("doubler")
        assert _metric(url, "carpool_replicas_abandoned_total") == 1
        assert _metric(url, "carpool_replica_threads_stuck") == 1

        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(_batch_http, url, (5.0, 6.0, 7.0, 8.0))
            gate.unlink()  # the fresh model is built: the requests behind run on it
            assert [r.json()["outputs"][0]["data"][0] for r in later.result(60)] == [
                10.0,
                12.0,
                14.0,
                16.0,
            ]
        wait_until(lambda: _status(url, "/v2/health/ready") == 200, "readiness back")
        assert grpc.is_model_ready("hanger")

        # Over gRPC the hung batch is DEADLINE_EXCEEDED.
        with ThreadPoolExecutor(4) as pool:
            outcomes = list(pool.map(lambda v: _infer_grpc(grpc, v), BATCH))
        assert all(isinstance(o, InferenceServerException) for o in outcomes), outcomes
        assert {o.status() for o in outcomes} == {"StatusCode.DEADLINE_EXCEEDED"}  # type: ignore[union-attr]
        assert _metric(url, "carpool_replicas_abandoned_total") == 2
    finally:
        grpc.close()
    # Stuck threads do not hold the exit: with nothing unanswered it is a clean one.
    assert server.stop() == 0, server.output()


def test_sigterm_with_a_request_stuck_exits_after_the_drain_timeout_with_status_1(
    start_server: StartServer, tmp_path: Path
) -> None:
    config = DOUBLER_CONFIG + MODEL.format(name="hanger", batch_timeout_s="null")
    env = {"CARPOOL_TEST_GATE": str(tmp_path / "gate")}
    server = start_server(config, env=env, args=["--drain-timeout-s", "2"])
    url = server.http_url
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(_batch_http, url, BATCH)
        wait_until(lambda: _busy(url), "the hung batch to be running")
        status = _terminated(server)
        answers = stuck.result(timeout=60)

    assert status == 1, server.output()
    assert [r.status_code for r in answers] == [503] * 4
    assert "4 request(s) still unanswered were cut off" in server.output()


def _terminated(server: ServedProcess) -> int:
    """SIGTERM ``server``; its exit status (a net of EXIT_LIMIT_S, not a timing)."""
    server.stopped = True
    server.process.terminate()
    try:
        return server.process.wait(timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        pytest.fail(f"carpool serve did not exit after SIGTERM:\n{server.output()}")


def _busy(url: str) -> bool:
    """Whether hanger's four requests were accepted and taken into a batch."""
    text = httpx.get(f"http://{url}/metrics", timeout=10).text
    accepted = pending = 0.0
    for line in text.splitlines():
        if 'model="hanger"' in line:
            if line.startswith("carpool_requests_total{"):
                accepted += float(line.rsplit(" ", 1)[1])
            elif line.startswith("carpool_pending_requests{"):
                pending += float(line.rsplit(" ", 1)[1])
    return accepted == len(BATCH) and pending == 0


def _completion(url: str) -> httpx.Response:
    body = {"model": "tiny-random-llama", "prompt": "hello", "max_tokens": 1000}
    return httpx.post(f"http://{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)


def _generating(url: str, count: int) -> bool:
    for line in httpx.get(f"http://{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("carpool_generation_requests_running{"):
            return float(line.rsplit(" ", 1)[1]) >= count
    return False


def test_a_drain_timeout_cuts_off_generation_requests_with_503(start_server: StartServer) -> None:
    """Was: a generation model's requests were not cut off (counted 0), and when the
    grace ended their connections were closed with no answer."""
    server = start_server(None, args=["--drain-timeout-s", "0.3"])  # the built-in models
    url = server.http_url
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(_completion, url) for _ in range(3)]
        wait_until(lambda: _generating(url, 3), "three completions generating")
        status = _terminated(server)
        answers = [job.result(timeout=60) for job in running]
    assert status == 1, server.output()
    assert [r.status_code for r in answers] == [503] * 3, [r.text for r in answers]
    assert "3 request(s) still unanswered were cut off" in server.output()
