"""``max_queue_time_s: auto`` over HTTP, as a Triton user sees it under overload.

A real ``carpool serve`` on 127.0.0.1 serves a model of 10 ms a batch of at most 4
items (about 400 requests a second), with ``slo_s`` 50 ms and its queue bounded in time
by it. 64 tritonclient clients on threads each make a bounded number of attempts, one
after the other: more than the model can answer within 50 ms arrives, so some are
refused at once with a 429 naming the bound; every request admitted is answered, and
answered right; the counts in ``/metrics`` agree with what the clients saw; the policy
endpoint shows the bound. Nothing is timed.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, StartServer

MODEL = '''\
"""10 ms a batch, whatever its size."""

import time


def slow(inputs):
    time.sleep(0.01)
    return {"Y": inputs["X"] * 2}
'''

CONFIG = """\
models:
  - name: slow
    kind: python
    source: queuetimemodels:slow
    inputs: [{name: X, datatype: FP32, shape: [1]}]
    outputs: [{name: Y, datatype: FP32, shape: [1]}]
    max_batch_size: 4
    max_delay_s: 0
    slo_s: 0.05
    max_queue_time_s: auto
    executor: thread
"""
NUM_CLIENTS = 64
NUM_ATTEMPTS = 8  # per client
REFUSED_PAUSE_S = 0.005  # a refused client waits this long before its next attempt
NORMAL = {"class": "normal"}  # requests that name no priority


@pytest.fixture
def served(start_server: StartServer, tmp_path_factory: pytest.TempPathFactory) -> ServedProcess:
    folder = tmp_path_factory.mktemp("queuetimemodels")
    (folder / "queuetimemodels.py").write_text(MODEL, encoding="utf-8")
    path = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    return start_server(CONFIG, env={"PYTHONPATH": path})


def _client(served: ServedProcess, k: int) -> tuple[int, int, list[str], list[str]]:
    """(answered right, refused, refusal messages, anything else that went wrong)."""
    client = httpclient.InferenceServerClient(served.http_url)
    right = refused = 0
    messages: list[str] = []
    wrong: list[str] = []
    try:
        for i in range(NUM_ATTEMPTS):
            value = float(k * 1000 + i)
            x = httpclient.InferInput("X", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[value]], dtype=np.float32))
            try:
                result = client.infer("slow", [x])
            except InferenceServerException as exc:
                if exc.status() != "429":
                    wrong.append(f"{exc.status()}: {exc.message()}")
                    continue
                refused += 1
                messages.append(exc.message())
                time.sleep(REFUSED_PAUSE_S)
                continue
            if result.as_numpy("Y")[0, 0] == 2 * value:
                right += 1
            else:
                wrong.append(f"request {value}: {result.as_numpy('Y')}")
        return right, refused, messages, wrong
    finally:
        client.close()


def _counter(served: ServedProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{served.http_url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_overload_is_refused_at_once_and_everything_admitted_is_answered(
    served: ServedProcess,
) -> None:
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        outcomes = list(pool.map(lambda k: _client(served, k), range(NUM_CLIENTS)))
    right = sum(o[0] for o in outcomes)
    refused = sum(o[1] for o in outcomes)
    messages = [m for o in outcomes for m in o[2]]
    wrong = [w for o in outcomes for w in o[3]]
    assert wrong == []
    assert right + refused == NUM_CLIENTS * NUM_ATTEMPTS
    assert refused > 0, "64 clients against 4 items per 10 ms: some cannot make 50 ms"
    assert right > 0
    assert all(
        "of work ahead of this request, more than the" in m
        and "slo_s=50.0 ms leaves for it (max_queue_time_s: auto)" in m
        for m in messages
    ), messages[:3]

    # The server counted what the clients saw, and keeps serving.
    assert _counter(
        served, "carpool_rejections_total", model="slow", reason="queue_full", **NORMAL
    ) == (refused)
    assert _counter(served, "carpool_requests_completed_total", model="slow", **NORMAL) == right
    assert _client(served, 999)[:2] == (NUM_ATTEMPTS, 0)

    policy = httpx.get(f"http://{served.http_url}/v2/models/slow/policy", timeout=10.0).json()
    assert policy["max_queue_time_s"] == "auto"
