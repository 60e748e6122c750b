"""`carpool serve` on loopback, driven by Triton's own gRPC client (and HTTP for stats)."""

from __future__ import annotations

from collections.abc import Iterator
from queue import Queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process

Server = ServedProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedProcess]:
    served = start_served_process(None, tmp_path_factory.mktemp("serve-grpc"), grpc=True)
    yield served
    assert served.stop() == 0, served.output()


@pytest.fixture
def client(server: Server) -> Iterator[grpcclient.InferenceServerClient]:
    assert server.grpc_url is not None
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _reference(x: np.ndarray) -> np.ndarray:
    import torch

    from carpool.models.mlp import build_w1

    with torch.inference_mode():
        return build_w1()(torch.from_numpy(x)).numpy()


def _input(x: np.ndarray, datatype: str = "FP32") -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def test_health_and_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "carpool"
    assert meta["version"]


def test_model_metadata(client: grpcclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("mlp", as_json=True)
    assert meta["name"] == "mlp"
    # as_json renders int64 as strings, as protobuf's JSON mapping does.
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "256"]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": ["-1", "16"]}]


def test_infer_matches_the_reference_model(client: grpcclient.InferenceServerClient) -> None:
    x = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    result = client.infer("mlp", [_input(x)], outputs=[output], request_id="r-1")
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), _reference(x), rtol=1e-5, atol=1e-5)
    assert result.get_response().id == "r-1"


def test_priority_and_timeout_parameters_are_accepted(
    client: grpcclient.InferenceServerClient,
) -> None:
    x = np.ones((1, 256), dtype=np.float32)
    result = client.infer("mlp", [_input(x)], priority=1, timeout=10_000_000)
    assert result.as_numpy("OUTPUT0").shape == (1, 16)


def test_concurrent_requests_share_batches(
    server: Server, client: grpcclient.InferenceServerClient
) -> None:
    x = np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32)
    expected = _reference(x)
    done: Queue[tuple[int, grpcclient.InferResult | None, InferenceServerException | None]]
    done = Queue()
    for i in range(64):
        client.async_infer(
            "mlp",
            [_input(x[i : i + 1])],
            callback=lambda result, error, i=i: done.put((i, result, error)),
        )
    rows: dict[int, np.ndarray] = {}
    for _ in range(64):
        i, result, error = done.get(timeout=60)
        assert error is None, error
        assert result is not None
        rows[i] = result.as_numpy("OUTPUT0")[0]
    np.testing.assert_allclose(
        np.stack([rows[i] for i in range(64)]), expected, rtol=1e-5, atol=1e-5
    )
    stats = httpx.get(f"http://{server.http_url}/v2/models/mlp/stats").json()["model_stats"][0]
    assert any(int(b["batch_size"]) > 1 for b in stats["batch_stats"])


@pytest.mark.parametrize(
    ("shape", "datatype", "fragment"),
    [
        ([1, 255], "FP32", "shape [1, 255]"),
        ([1, 256], "FP64", "datatype"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_problem(
    client: grpcclient.InferenceServerClient, shape: list[int], datatype: str, fragment: str
) -> None:
    x = np.zeros(shape, dtype=np.float32 if datatype == "FP32" else np.float64)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("mlp", [_input(x, datatype)])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert fragment in caught.value.message()


def test_unknown_model_is_not_found(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", [_input(np.zeros((1, 256), dtype=np.float32))])
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "nope" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_http_serves_alongside_grpc(server: Server) -> None:
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]
    }
    response = httpx.post(f"http://{server.http_url}/v2/models/mlp/infer", json=body)
    assert response.status_code == 200
