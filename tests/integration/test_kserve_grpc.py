"""`carpool serve` on loopback, driven by Triton's own gRPC client (and HTTP for stats)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2
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


def _http_json(server: Server, path: str) -> Any:
    response = httpx.get(f"http://{server.http_url}{path}")
    assert response.status_code == 200, response.text
    return response.json()


def test_repository_index_lists_every_model_ready(
    server: Server, client: grpcclient.InferenceServerClient
) -> None:
    index = client.get_model_repository_index(as_json=True)["models"]
    assert "mlp" in {m["name"] for m in index}
    for model in index:
        assert (model["version"], model["state"]) == ("1", "READY")
        assert httpx.get(f"http://{server.http_url}/v2/models/{model['name']}/ready").is_success


def test_model_config_says_what_http_says(
    server: Server, client: grpcclient.InferenceServerClient
) -> None:
    for model in client.get_model_repository_index().models:
        over_grpc = client.get_model_config(model.name, as_json=True)["config"]
        over_http = _http_json(server, f"/v2/models/{model.name}/config")
        # Both JSON forms read into Triton's own ModelConfig (int64s are strings in one).
        as_triton = [
            json_format.ParseDict(c, model_config_pb2.ModelConfig()) for c in (over_grpc, over_http)
        ]
        assert as_triton[0] == as_triton[1], (over_grpc, over_http)
    config = client.get_model_config("mlp").config
    assert (config.name, config.max_batch_size) == ("mlp", 64)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("INPUT0", model_config_pb2.TYPE_FP32, [256])
    ]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU


def test_inference_statistics_grow_and_match_http(
    server: Server, client: grpcclient.InferenceServerClient
) -> None:
    before = client.get_inference_statistics("mlp").model_stats[0]
    for _ in range(5):
        client.infer("mlp", [_input(np.ones((1, 256), dtype=np.float32))])
    after = client.get_inference_statistics("mlp").model_stats[0]
    assert after.inference_count == before.inference_count + 5
    assert after.inference_stats.success.count == before.inference_stats.success.count + 5
    assert after.inference_stats.success.ns > before.inference_stats.success.ns
    assert after.execution_count > before.execution_count
    assert after.batch_stats
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count
    # Nothing runs now, so both wires report the very same numbers.
    over_http = _http_json(server, "/v2/models/mlp/stats")
    # Over HTTP each model also carries carpool's own live figures (server/live.py),
    # beside Triton's: an extra key JSON clients pass over, and no field of the proto.
    for stats in over_http["model_stats"]:
        assert stats.pop("carpool")["num_items"] >= 5
    as_triton = json_format.ParseDict(over_http, service_pb2.ModelStatisticsResponse())
    assert client.get_inference_statistics("mlp") == as_triton
    everyone = client.get_inference_statistics().model_stats
    assert "mlp" in {m.name for m in everyone}


StreamAnswer = tuple[grpcclient.InferResult | None, InferenceServerException | None]


def _stream(
    client: grpcclient.InferenceServerClient, requests: list[tuple[str, np.ndarray]]
) -> list[StreamAnswer]:
    """Send every request on one stream; the answers in the order they came."""
    answers: Queue[StreamAnswer] = Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for request_id, x in requests:
            client.async_stream_infer("mlp", [_input(x)], request_id=request_id)
        return [answers.get(timeout=60) for _ in requests]
    finally:
        client.stop_stream()


def test_stream_answers_every_request_matched_by_id(
    client: grpcclient.InferenceServerClient,
) -> None:
    x = np.random.default_rng(2).standard_normal((16, 256), dtype=np.float32)
    answers = _stream(client, [(f"s-{i}", x[i : i + 1]) for i in range(16)])
    rows: dict[str, np.ndarray] = {}
    for result, error in answers:
        assert error is None, error
        assert result is not None
        rows[result.get_response().id] = result.as_numpy("OUTPUT0")[0]
    assert sorted(rows) == sorted(f"s-{i}" for i in range(16))
    np.testing.assert_allclose(
        np.stack([rows[f"s-{i}"] for i in range(16)]), _reference(x), rtol=1e-5, atol=1e-5
    )


def test_a_bad_request_on_a_stream_fails_alone(client: grpcclient.InferenceServerClient) -> None:
    good = np.ones((1, 256), dtype=np.float32)
    requests = [("g-0", good), ("bad", np.ones((1, 255), dtype=np.float32)), ("g-1", good)]
    answers = _stream(client, [*requests, ("g-2", good)])
    errors = [error for _, error in answers if error is not None]
    assert len(errors) == 1
    assert "shape [1, 255]" in errors[0].message()
    ids = {result.get_response().id for result, _ in answers if result is not None}
    assert ids == {"g-0", "g-1", "g-2"}


def test_grpc_model_config_of_queue_bounds_past_tritons_field_widths(start_server: Any) -> None:
    # A model-wide max_queue_size past uint32 and a class timeout past uint64 microseconds
    # made gRPC ModelConfig fail (the JSON could not be put in the proto); a class timeout
    # under half a microsecond was shown as 0, Triton's "no timeout".
    config = textwrap.dedent("""\
        models:
          - name: double
            kind: python
            source: configmodels:double
            inputs: [{name: INPUT0, datatype: FP32, shape: [4]}]
            outputs: [{name: OUTPUT0, datatype: FP32, shape: [4]}]
            max_queue_size: 10000000000
            max_delay_s: 1.0e+20
            classes:
              - {name: forever, timeout_s: 1.0e+20}
              - {name: instant, timeout_s: 1.0e-7}
            default_class: forever
        """)
    served = start_server(config, grpc=True)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        batching = client.get_model_config("double", as_json=True)["config"]["dynamic_batching"]
    finally:
        client.close()
    levels = batching["priority_queue_policy"]
    # as_json writes uint64 as strings and uint32 as numbers, as protobuf's JSON does
    assert levels["1"]["default_timeout_microseconds"] == str(2**64 - 1)
    assert levels["1"]["max_queue_size"] == 2**32 - 1
    assert levels["2"]["default_timeout_microseconds"] == "1"
    assert batching["default_queue_policy"] == levels["1"]
    assert batching["max_queue_delay_microseconds"] == str(2**64 - 1)
    rest = httpclient.InferenceServerClient(served.http_url)
    try:
        rest_levels = rest.get_model_config("double")["dynamic_batching"]["priority_queue_policy"]
    finally:
        rest.close()
    assert rest_levels["1"]["max_queue_size"] == 2**32 - 1  # both wires say the same
    assert rest_levels["2"]["default_timeout_microseconds"] == 1
