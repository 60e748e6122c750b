"""`carpool serve` on loopback, driven by Triton's own HTTP client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import start_served_process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    served = start_served_process(None, tmp_path_factory.mktemp("serve-http"))
    yield served.http_url
    assert served.stop() == 0, served.output()


@pytest.fixture
def client(server: str) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server, concurrency=16)
    yield client
    client.close()


def _reference(x: np.ndarray) -> np.ndarray:
    import torch

    from carpool.models.mlp import build_w1

    with torch.inference_mode():
        return build_w1()(torch.from_numpy(x)).numpy()


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    meta = client.get_server_metadata()
    assert meta["name"] == "carpool"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("mlp")
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 256]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    config = client.get_model_config("mlp")
    assert config["max_batch_size"] == 64
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000


@pytest.mark.parametrize("binary", [True, False])
def test_infer_matches_the_reference_model(
    client: httpclient.InferenceServerClient, binary: bool
) -> None:
    x = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [3, 256], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer("mlp", [inp], outputs=[out])
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), _reference(x), rtol=1e-5, atol=1e-5)


def test_concurrent_requests_share_batches(client: httpclient.InferenceServerClient) -> None:
    x = np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32)
    expected = _reference(x)

    pending = []
    for i in range(64):
        inp = httpclient.InferInput("INPUT0", [1, 256], "FP32")
        inp.set_data_from_numpy(x[i : i + 1])
        pending.append(client.async_infer("mlp", [inp]))
    results = [p.get_result().as_numpy("OUTPUT0")[0] for p in pending]
    np.testing.assert_allclose(np.stack(results), expected, rtol=1e-5, atol=1e-5)
    stats = client.get_inference_statistics("mlp")["model_stats"][0]
    assert any(int(b["batch_size"]) > 1 for b in stats["batch_stats"])
    assert int(stats["inference_count"]) >= 64


@pytest.mark.parametrize(
    ("shape", "datatype", "fragment"),
    [
        ([1, 255], "FP32", "shape"),
        ([1, 256], "FP64", "datatype"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(
    client: httpclient.InferenceServerClient, shape: list[int], datatype: str, fragment: str
) -> None:
    inp = httpclient.InferInput("INPUT0", shape, datatype)
    inp.set_data_from_numpy(np.zeros(shape, dtype=np.float32 if datatype == "FP32" else np.float64))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("mlp", [inp])
    assert caught.value.status() == "400"
    assert fragment in caught.value.message()


def test_unknown_model_is_a_404(server: str) -> None:
    response = httpx.get(f"http://{server}/v2/models/nope")
    assert response.status_code == 404
    assert "nope" in response.json()["error"]


def test_malformed_json_is_a_400_and_good_requests_still_succeed(
    server: str, client: httpclient.InferenceServerClient
) -> None:
    response = httpx.post(f"http://{server}/v2/models/mlp/infer", content=b"{not json")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]
    x = np.zeros((1, 256), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 256], "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("mlp", [inp]).as_numpy("OUTPUT0").shape == (1, 16)


def test_asyncio_client_works_too(server: str) -> None:
    import tritonclient.http.aio as aioclient

    async def run() -> np.ndarray:
        client = aioclient.InferenceServerClient(server)
        try:
            inp = aioclient.InferInput("INPUT0", [2, 256], "FP32")
            inp.set_data_from_numpy(np.ones((2, 256), dtype=np.float32))
            return (await client.infer("mlp", [inp])).as_numpy("OUTPUT0")
        finally:
            await client.close()

    assert asyncio.run(run()).shape == (2, 16)


def test_metrics_parse_and_count_what_was_served(
    server: str, client: httpclient.InferenceServerClient
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    inp = httpclient.InferInput("INPUT0", [2, 256], "FP32")
    inp.set_data_from_numpy(np.ones((2, 256), dtype=np.float32))
    client.infer("mlp", [inp])
    response = httpx.get(f"http://{server}/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in (
        "carpool_requests",
        "carpool_batches",
        "carpool_batch_size",
        "carpool_request_latency_seconds",
        "carpool_queue_wait_seconds",
        "carpool_fill_ratio",
        "carpool_effective_compute_ratio",
        "carpool_pending_requests",
        "carpool_replica_busy_fraction",
    ):
        assert name in families, name
    requests = {
        s.labels["class"]: s.value
        for s in families["carpool_requests"].samples
        if s.labels.get("model") == "mlp" and s.name == "carpool_requests_total"
    }
    assert requests["normal"] >= 1
    fill = next(s.value for s in families["carpool_fill_ratio"].samples)
    assert 0.0 < fill <= 1.0


def test_readme_client_example_runs_against_the_server(server: str) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "tritonclient" in b)
    code = block.replace('"127.0.0.1:8000"', repr(server))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "batch_size" in result.stdout


def test_readme_curl_body_is_accepted(server: str) -> None:
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]
    }
    response = httpx.post(f"http://{server}/v2/models/mlp/infer", json=body)
    assert response.status_code == 200
    output = response.json()["outputs"][0]
    assert output["name"] == "OUTPUT0" and output["shape"] == [1, 16]
    assert len(output["data"]) == 16
