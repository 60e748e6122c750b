"""``max_delay_s: auto`` and ``max_batch_size: auto`` over HTTP, as a Triton user sees them.

A real ``carpool serve`` on 127.0.0.1 serves a model whose batch time grows with the
batch (2 ms + 0.1 ms per item). One tritonclient HTTP client sends requests one after
the other: the batches stay at one item. Then 64 clients on threads, each one request
after the other: the batches grow, and ``/metrics`` (``carpool_batch_size``, ``carpool_adaptive_*``,
``carpool_arrival_rate``, ``carpool_batch_time_fit_*``) and ``/v2/models/{m}/policy``
show what the controller has in force. Request counts are bounded; nothing is timed.

With priority classes, the same model on the event loop (``executor: loop``, as ``auto``
puts it on one core): 64 background clients and an interactive one (priority 1, its
``slo_s`` 12 ms). What ``/v2/models/{m}/policy`` has in force while both have traffic
keeps the interactive promise by the controller's own fitted line: the largest
background batch it may wait for, read only afterwards, plus its own batch fit in its
budget (80% of ``slo_s``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServedProcess, StartServer

MODEL = '''\
"""A model whose batch time grows with the batch: 2 ms + 0.1 ms per item."""

import time


def linear(inputs):
    x = inputs["X"]
    time.sleep(0.002 + 0.0001 * len(x))
    return {"Y": x * 2}
'''

CONFIG = """\
models:
  - name: linear
    kind: python
    source: adaptivemodels:linear
    inputs: [{name: X, datatype: FP32, shape: [1]}]
    outputs: [{name: Y, datatype: FP32, shape: [1]}]
    max_batch_size: auto
    max_delay_s: auto
    slo_s: 0.2
    executor: thread
"""
# The same model on the event loop, 64 items at most, with an interactive class.
PRIORITY_CONFIG = CONFIG.replace("max_batch_size: auto", "max_batch_size: 64").replace(
    "executor: thread", "executor: loop"
) + (
    "    default_class: background\n"
    "    classes:\n"
    "      - {name: interactive, slo_s: 0.012}\n"
    "      - {name: background}\n"
)
NUM_ALONE = 150
NUM_CONCURRENT = 64
NUM_PER_CLIENT = 30


@pytest.fixture
def served(start_server: StartServer, tmp_path_factory: pytest.TempPathFactory) -> ServedProcess:
    return start_server(CONFIG, env={"PYTHONPATH": str(_model_dir(tmp_path_factory))})


def _model_dir(factory: pytest.TempPathFactory) -> str:
    import os

    folder = factory.mktemp("adaptivemodels")
    (folder / "adaptivemodels.py").write_text(MODEL, encoding="utf-8")
    here = os.path.dirname(__file__)
    return os.pathsep.join([str(folder), here, os.environ.get("PYTHONPATH", "")])


@pytest.fixture
def client(served: ServedProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.http_url)
    yield client
    client.close()


def _client_loop(served: ServedProcess, k: int, priority: int = 0) -> int:
    """One of the concurrent clients: NUM_PER_CLIENT requests one after the other; how
    many answers were wrong."""
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        wrong = 0
        for i in range(NUM_PER_CLIENT):
            value = float(k * 1000 + i)
            result = client.infer("linear", _inputs(value), priority=priority)
            wrong += result.as_numpy("Y")[0, 0] != 2 * value
        return wrong
    finally:
        client.close()


def _inputs(value: float) -> list[httpclient.InferInput]:
    x = httpclient.InferInput("X", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    return [x]


def _metrics(served: ServedProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://{served.http_url}/metrics", timeout=10.0).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _batches(served: ServedProcess) -> tuple[float, float]:
    """(batches run, items in them) of the model so far."""
    metrics = _metrics(served)
    key = (("model", "linear"),)
    return metrics[("carpool_batch_size_count", key)], metrics[("carpool_batch_size_sum", key)]


def test_the_batch_size_follows_the_load_from_one_client_to_64(
    served: ServedProcess, client: httpclient.InferenceServerClient
) -> None:
    for i in range(NUM_ALONE):
        result = client.infer("linear", _inputs(float(i)))
        assert result.as_numpy("Y")[0, 0] == 2 * i
    batches_alone, items_alone = _batches(served)
    assert items_alone == NUM_ALONE
    # One client at a time: nothing ever has company, every batch holds one item.
    assert batches_alone == NUM_ALONE

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        wrong = sum(pool.map(lambda k: _client_loop(served, k), range(NUM_CONCURRENT)))
    assert wrong == 0
    batches_all, items_all = _batches(served)
    num_batches = batches_all - batches_alone
    mean_loaded = (items_all - items_alone) / num_batches
    assert items_all - items_alone == NUM_CONCURRENT * NUM_PER_CLIENT
    assert mean_loaded >= 4, f"64 clients: batches of {mean_loaded:.1f} items on average"

    metrics = _metrics(served)
    normal = (("class", "normal"), ("model", "linear"))
    assert metrics[("carpool_arrival_rate", normal)] > 0
    assert metrics[("carpool_arrival_rate_while_waiting", normal)] > 0
    assert metrics[("carpool_adaptive_batch_size", normal)] >= 1
    assert 1 <= metrics[("carpool_adaptive_max_batch_size", normal)] <= 256
    assert metrics[("carpool_adaptive_delay_seconds", normal)] >= 0
    assert 0 <= metrics[("carpool_adaptive_closed_loop_share", normal)] <= 1
    # No queue bound in time: nothing refused, nothing capped for it.
    assert metrics[("carpool_adaptive_refusing", normal)] == 0
    fit = (("model", "linear"),)
    # The fitted line saw batches from 1 to dozens of items of the 2 ms + 0.1 ms model.
    assert metrics[("carpool_batch_time_fit_per_item_seconds", fit)] > 0
    assert metrics[("carpool_batch_time_fit_overhead_seconds", fit)] > 0
    assert metrics[("carpool_batch_time_fit_stretch", fit)] >= 1
    # No token or cost budget: the controller counts items.
    assert metrics[("carpool_adaptive_unit", (("model", "linear"), ("unit", "items")))] == 1

    policy = httpx.get(f"http://{served.http_url}/v2/models/linear/policy", timeout=10.0).json()
    assert policy["max_delay_s"] == "auto" and policy["max_batch_size"] == "auto"
    assert policy["slo_s"] == 0.2
    adaptive = policy["adaptive"]
    assert set(adaptive["classes"]) == {"interactive", "normal", "background"}
    assert adaptive["classes"]["normal"]["arrival_rate_rps"] > 0
    assert adaptive["classes"]["normal"]["company_rate_rps"] > 0
    assert 0 <= adaptive["classes"]["normal"]["closed_loop_share"] <= 1
    assert adaptive["classes"]["normal"]["refusing"] is False
    assert adaptive["batch_time_fit"]["stretch"] >= 1
    assert adaptive["batch_time_fit"]["num_batches"] > 0
    assert adaptive["unit"] == "items"


def test_lower_class_batches_and_the_fill_fit_the_interactive_budget_together(
    start_server: StartServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    served = start_server(PRIORITY_CONFIG, env={"PYTHONPATH": str(_model_dir(tmp_path_factory))})
    url = f"http://{served.http_url}/v2/models/linear/policy"
    in_force: list[dict[str, Any]] = []

    def interactive() -> int:
        client = httpclient.InferenceServerClient(served.http_url)
        try:
            wrong = 0
            for i in range(NUM_PER_CLIENT * 4):
                result = client.infer("linear", _inputs(float(i)), priority=1)
                wrong += result.as_numpy("Y")[0, 0] != 2 * i
                in_force.append(httpx.get(url, timeout=10.0).json()["adaptive"])
            return wrong
        finally:
            client.close()

    with ThreadPoolExecutor(NUM_CONCURRENT + 1) as pool:
        watcher = pool.submit(interactive)
        wrong = sum(pool.map(lambda k: _client_loop(served, k), range(NUM_CONCURRENT)))
        wrong += watcher.result()
    assert wrong == 0
    budget_s = 0.8 * 0.012
    checked = 0
    for adaptive in in_force:
        classes, fit = adaptive["classes"], adaptive["batch_time_fit"]
        rates = [classes[name]["arrival_rate_rps"] for name in ("interactive", "background")]
        if fit["num_batches"] < 8 or min(rates) < 0.5:
            continue  # cold, or one class without traffic: nothing is promised
        checked += 1
        lower = classes["background"]["max_batch_size"]
        own = classes["interactive"]["max_batch_size"]

        def t(b: int, line: dict[str, float] = fit) -> float:
            return line["overhead_s"] + line["per_item_s"] * b

        # The background cap stops at a quarter of its 64 (LOWER_MIN_SHARE).
        if t(16) + t(1) <= budget_s:  # a promise the model's speed allows
            assert t(lower) + t(own) <= budget_s + 1e-9, (lower, own, fit)
    assert checked > 0
