"""Graceful shutdown of a real `carpool serve` with gRPC and ASGI-path HTTP requests
running and queued: all answered, new gRPC calls refused, exit 0."""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .conftest import StartServer, wait_until

CONFIG = """\
models:
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 1
    max_delay_s: 0.001
"""
LIMIT_S = 20.0


def _input(value: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("X", [1, 1], "INT64")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int64))
    return tensor


def _pending(http_url: str) -> float:
    text = httpx.get(f"http://{http_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("carpool_pending_requests{") and 'model="gated"' in line
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_answers_running_and_queued_grpc_requests_and_refuses_new_ones(
    start_server: StartServer, tmp_path: Path, signum: signal.Signals
) -> None:
    seen, gate = tmp_path / "seen.txt", tmp_path / "gate"
    gate.touch()
    env = {"CARPOOL_TEST_SEEN": str(seen), "CARPOOL_TEST_GATE": str(gate)}
    server = start_server(CONFIG, grpc=True, env=env)
    assert server.grpc_url is not None
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: Queue[tuple[int, Any, Any]] = Queue()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        for value in (1, 2):
            client.async_infer(
                "gated",
                [_input(value)],
                callback=lambda result, error, v=value: answers.put((v, result, error)),
            )
            if value == 1:
                wait_until(lambda: seen.exists() and "1" in seen.read_text().split(), "1 runs")
        body = {"inputs": [{"name": "X", "shape": [1, 1], "datatype": "INT64", "data": [4]}]}
        url = f"http://{server.http_url}/v2/models/gated/infer?via=asgi"  # not the fast path
        rest = pool.submit(httpx.post, url, json=body, timeout=LIMIT_S * 2)
        wait_until(lambda: _pending(server.http_url) == 2, "2 and 4 to be queued")
        server.process.send_signal(signum)
        server.stopped = True
        time.sleep(0.5)  # let the server begin its drain
        late = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            late.infer("gated", [_input(3)], client_timeout=5)
            refused = None
        except InferenceServerException as refusal:
            refused = refusal.status()
        finally:
            late.close()
        gate.unlink()
        got = {}
        for _ in range(2):
            value, result, error = answers.get(timeout=LIMIT_S)
            got[value] = error if error is not None else int(result.as_numpy("Y")[0, 0])
        answer = rest.result(timeout=LIMIT_S)
        got[4] = answer.json()["outputs"][0]["data"][0] if answer.status_code == 200 else answer
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        gate.unlink(missing_ok=True)
        client.close()
    assert got == {1: 1, 2: 2, 4: 4}, got
    assert refused == "StatusCode.UNAVAILABLE", refused
    try:
        status = server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        raise
    assert status == 0, server.output()
    assert "3" not in seen.read_text().split()
    assert "Traceback" not in server.output(), server.output()
