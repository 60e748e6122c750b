"""`carpool serve` with ``buffer_pool: true``: concurrent requests to a model that returns
its (pooled) input each get their own values back, and ``/metrics`` shows the pool."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServedProcess, start_served_process

CONFIG = """\
models:
  - name: echo
    kind: python
    source: configmodels:identity
    inputs: [{name: IN_X, datatype: FP32, shape: [4]}]
    outputs: [{name: OUT_X, datatype: FP32, shape: [4]}]
    max_batch_size: 8
    max_delay_s: 0.05             # tritonclient sends every 10 ms: batches of several
    buffer_pool: true
    buffer_pool_mb: 8
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    server = start_served_process(CONFIG, tmp_path_factory.mktemp("buffer-pool"))
    yield server
    assert server.stop() == 0, server.output()


def _metrics(served: ServedProcess) -> dict[str, float]:
    text = httpx.get(f"http://{served.http_url}/metrics", timeout=30).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("carpool_buffer_pool") and s.labels.get("model") == "echo"
    }


def test_each_request_gets_its_own_values_and_metrics_show_reuse(served: ServedProcess) -> None:
    client = httpclient.InferenceServerClient(served.http_url, concurrency=16)
    try:
        calls = []
        for i in range(160):  # bounded: 10 rounds of 16 in flight
            x = np.full((1, 4), float(i), np.float32)
            infer_input = httpclient.InferInput("IN_X", [1, 4], "FP32")
            infer_input.set_data_from_numpy(x)
            calls.append((i, client.async_infer("echo", [infer_input])))
        for i, call in calls:
            got = call.get_result().as_numpy("OUT_X")
            assert got.tolist() == [[float(i)] * 4], i
    finally:
        client.close()
    metrics = _metrics(served)
    # A batch of one request is that request's own arrays (no copy, no pool); the others
    # are collated into the pool, and 160 requests make more batches than size buckets.
    assert metrics["carpool_buffer_pool_hits_total"] > 0
    assert metrics["carpool_buffer_pool_misses_total"] >= 1
    assert metrics["carpool_buffer_pool_evictions_total"] == 0
    assert metrics["carpool_buffer_pool_budget_bytes"] == 8 * 2**20
    assert 0 < metrics["carpool_buffer_pool_bytes"] <= 8 * 2**20
