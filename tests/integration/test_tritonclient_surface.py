"""What a Triton user's scripts call through ``tritonclient`` beyond a plain ``infer``: the
asyncio clients of both wires, ``async_infer`` with its callbacks and greenlets, streams,
compression, custom headers and parameters; and the extensions carpool does not implement,
each refused with an error naming it (HTTP 501 / gRPC UNIMPLEMENTED for an endpoint, 400 /
INVALID_ARGUMENT for a request parameter), never answered as if it had not been asked."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from .conftest import DOUBLER_CONFIG, ServedProcess, start_served_process, wait_until

WAIT_LIMIT_S = 30.0
CONFIG = (
    DOUBLER_CONFIG
    + """\
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 4
    max_delay_s: 0.001
    executor: thread             # it blocks while gated: never on the event loop
"""
)
# What carpool serves, as Triton names its extensions; and what it does not.
SERVED = {"binary_tensor_data", "classification", "model_configuration", "statistics",
          "parameters", "schedule_policy"}  # fmt: skip
NOT_SERVED = {"model_repository", "system_shared_memory", "cuda_shared_memory", "trace",
              "logging", "sequence"}  # fmt: skip
# No query string: the HTTP infer fast path; a query string: the ASGI path.
PATHS = [None, {"via": "asgi"}]
PATH_IDS = ["fast", "asgi"]


class Served:
    def __init__(self, process: ServedProcess, seen: Path, gate: Path) -> None:
        assert process.grpc_url is not None
        self.http_url = process.http_url
        self.grpc_url = process.grpc_url
        self.seen = seen
        self.gate = gate

    def seen_values(self) -> list[int]:
        return [int(v) for v in self.seen.read_text().split()] if self.seen.exists() else []

    def num_pending(self, model: str) -> int:
        text = httpx.get(f"http://{self.http_url}/metrics", timeout=5).text
        pattern = rf'^carpool_pending_requests{{[^}}]*model="{model}"[^}}]*}} (\S+)$'
        return int(sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE)))

    def batch_sizes(self, model: str) -> set[int]:
        url = f"http://{self.http_url}/v2/models/{model}/stats"
        stats = httpx.get(url, timeout=5).json()["model_stats"][0]
        return {int(b["batch_size"]) for b in stats["batch_stats"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tritonclient-surface")
    seen, gate = folder / "seen.txt", folder / "gate"
    env = {"CARPOOL_TEST_SEEN": str(seen), "CARPOOL_TEST_GATE": str(gate)}
    process = start_served_process(CONFIG, folder, grpc=True, env=env)
    try:
        yield Served(process, seen, gate)
    finally:
        gate.unlink(missing_ok=True)
        assert process.stop() == 0, process.output()
        assert "Traceback" not in process.output(), process.output()


@pytest.fixture
def http(served: Served) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(served.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(served.grpc_url)
    yield client
    client.close()


def _row(module: Any, value: float, *, binary: bool = True) -> Any:
    tensor = module.InferInput("INPUT0", [1, 2], "FP32")
    data = np.array([[value, -1.0]], dtype=np.float32)
    if module in (httpclient, httpaio):
        tensor.set_data_from_numpy(data, binary_data=binary)
    else:
        tensor.set_data_from_numpy(data)
    return tensor


def _x(module: Any, value: int) -> Any:
    tensor = module.InferInput("X", [1, 1], "INT64")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int64))
    return tensor


def _doubled(result: Any) -> list[list[float]]:
    return result.as_numpy("OUTPUT0").tolist()


# -- the asyncio clients -----------------------------------------------------------------


async def test_http_aio_client_answers_every_call_carpool_serves(served: Served) -> None:
    client = httpaio.InferenceServerClient(served.http_url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("doubler")
        assert not await client.is_model_ready("nope")
        assert set((await client.get_server_metadata())["extensions"]) == SERVED
        metadata = await client.get_model_metadata("doubler")
        assert metadata["inputs"][0]["name"] == "INPUT0"
        assert (await client.get_model_config("doubler"))["max_batch_size"] == 8
        index = await client.get_model_repository_index()
        assert {(m["name"], m["state"]) for m in index} == {
            ("doubler", "READY"),
            ("gated", "READY"),
        }
        binary = await client.infer("doubler", [_row(httpaio, 1.5)], request_id="b")
        as_json = await client.infer(
            "doubler",
            [_row(httpaio, 2.5, binary=False)],
            outputs=[httpaio.InferRequestedOutput("OUTPUT0", binary_data=False)],
        )
        stats = await client.get_inference_statistics("doubler")
    finally:
        await client.close()
    assert (_doubled(binary), binary.get_response()["id"]) == ([[3.0, -2.0]], "b")
    assert _doubled(as_json) == [[5.0, -2.0]]
    assert "data" in as_json.get_response()["outputs"][0]  # JSON, as asked
    assert stats["model_stats"][0]["inference_count"] >= 2


async def test_grpc_aio_client_answers_every_call_carpool_serves(served: Served) -> None:
    client = grpcaio.InferenceServerClient(served.grpc_url)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("doubler")
        assert not await client.is_model_ready("nope")
        metadata = await client.get_server_metadata(as_json=True)
        assert set(metadata["extensions"]) == SERVED - {"binary_tensor_data"}  # HTTP's
        model = await client.get_model_metadata("doubler", as_json=True)
        assert model["inputs"][0]["name"] == "INPUT0"
        config = await client.get_model_config("doubler", as_json=True)
        assert config["config"]["max_batch_size"] == 8
        index = await client.get_model_repository_index(as_json=True)
        assert {m["name"] for m in index["models"]} == {"doubler", "gated"}
        result = await client.infer(
            "doubler", [_row(grpcaio, 4.0)], request_id="g", client_timeout=WAIT_LIMIT_S
        )

        async def requests() -> Any:
            for k in range(6):
                yield {"model_name": "doubler", "inputs": [_row(grpcaio, k)], "request_id": f"s{k}"}

        streamed = [(r, e) async for r, e in client.stream_infer(requests())]
        stats = await client.get_inference_statistics("doubler", as_json=True)
    finally:
        await client.close()
    assert (_doubled(result), result.get_response().id) == ([[8.0, -2.0]], "g")
    assert [e for _, e in streamed] == [None] * 6
    assert [r.get_response().id for r, _ in streamed] == [f"s{k}" for k in range(6)]
    assert [_doubled(r)[0][0] for r, _ in streamed] == [2.0 * k for k in range(6)]
    assert int(stats["model_stats"][0]["inference_count"]) >= 7


async def test_aio_clients_of_both_wires_share_batches(served: Served) -> None:
    # The replica is held on a first request; the others queue behind it, so they must
    # leave in batches of several, HTTP and gRPC requests together.
    http = httpaio.InferenceServerClient(served.http_url)
    grpc = grpcaio.InferenceServerClient(served.grpc_url)
    served.gate.touch()
    try:
        first = asyncio.ensure_future(grpc.infer("gated", [_x(grpcaio, 500)]))
        await asyncio.to_thread(
            wait_until, lambda: 500 in served.seen_values(), "the first request to run"
        )
        calls = [
            (http if k % 2 else grpc).infer("gated", [_x(httpaio if k % 2 else grpcaio, k)])
            for k in range(501, 509)
        ]
        rest = asyncio.gather(*calls)
        await asyncio.to_thread(
            wait_until, lambda: served.num_pending("gated") == 8, "eight queued requests"
        )
        served.gate.unlink()
        results = [await first, *await rest]
    finally:
        served.gate.unlink(missing_ok=True)
        await http.close()
        await grpc.close()
    assert [int(r.as_numpy("Y")[0, 0]) for r in results] == list(range(500, 509))
    assert max(served.batch_sizes("gated")) > 1


# -- the sync clients' asynchronous calls ------------------------------------------------


def test_http_async_infer_on_a_pool_of_connections_answers_each_request(
    served: Served,
) -> None:
    client = httpclient.InferenceServerClient(served.http_url, concurrency=8)
    try:
        pending = [
            client.async_infer("doubler", [_row(httpclient, k)], request_id=f"a{k}")
            for k in range(16)
        ]
        results = [p.get_result(timeout=WAIT_LIMIT_S) for p in pending]
    finally:
        client.close()
    assert [r.get_response()["id"] for r in results] == [f"a{k}" for k in range(16)]
    assert [_doubled(r)[0][0] for r in results] == [2.0 * k for k in range(16)]


def test_grpc_stream_compressed_carries_headers_and_answers_in_order(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    answers: Queue[tuple[Any, Any]] = Queue()
    grpc.start_stream(
        callback=lambda result, error: answers.put((result, error)),
        headers={"x-user": "triton-script"},
        compression_algorithm="gzip",
    )
    try:
        for k in range(5):
            grpc.async_stream_infer("doubler", [_row(grpcclient, k)], request_id=f"c{k}")
        got = [answers.get(timeout=WAIT_LIMIT_S) for _ in range(5)]
    finally:
        grpc.stop_stream()
    assert [error for _, error in got] == [None] * 5
    assert [r.get_response().id for r, _ in got] == [f"c{k}" for k in range(5)]


# -- compression, headers, parameters ----------------------------------------------------


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_compressed_request_and_response_are_read(
    http: httpclient.InferenceServerClient, algorithm: str, query: dict[str, str] | None
) -> None:
    result = http.infer(
        "doubler",
        [_row(httpclient, 3.0)],
        query_params=query,
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    assert _doubled(result) == [[6.0, -2.0]]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_grpc_compressed_call_is_read(
    grpc: grpcclient.InferenceServerClient, algorithm: str
) -> None:
    result = grpc.infer("doubler", [_row(grpcclient, 3.0)], compression_algorithm=algorithm)
    assert _doubled(result) == [[6.0, -2.0]]


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_headers_custom_parameters_and_schedule_policy_are_accepted(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    result = http.infer(
        "doubler",
        [_row(httpclient, 1.0)],
        query_params=query,
        request_id="h-1",
        headers={"X-Request-Source": "script"},
        parameters={"note": "any", "level": 3, "flag": True},
        priority=1,
        timeout=10_000_000,
    )
    assert (_doubled(result), result.get_response()["id"]) == ([[2.0, -2.0]], "h-1")


def test_grpc_headers_custom_parameters_and_schedule_policy_are_accepted(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    result = grpc.infer(
        "doubler",
        [_row(grpcclient, 1.0)],
        request_id="g-1",
        headers={"x-request-source": "script"},
        parameters={"note": "any", "level": 3, "flag": True},
        priority=2,
        timeout=10_000_000,
        client_timeout=WAIT_LIMIT_S,
    )
    assert (_doubled(result), result.get_response().id) == ([[2.0, -2.0]], "g-1")


# -- extensions carpool does not implement -----------------------------------------------

HTTP_UNSERVED: list[tuple[str, Callable[[httpclient.InferenceServerClient], Any], str]] = [
    ("load", lambda c: c.load_model("doubler"), "model repository"),
    ("unload", lambda c: c.unload_model("doubler"), "model repository"),
    ("shm_status", lambda c: c.get_system_shared_memory_status(), "system shared memory"),
    ("shm_register", lambda c: c.register_system_shared_memory("r", "/k", 8),
     "system shared memory"),
    ("shm_unregister", lambda c: c.unregister_system_shared_memory(), "system shared memory"),
    ("cuda_status", lambda c: c.get_cuda_shared_memory_status(), "CUDA shared memory"),
    ("cuda_unregister", lambda c: c.unregister_cuda_shared_memory("r"), "CUDA shared memory"),
    ("trace", lambda c: c.get_trace_settings(), "trace"),
    ("trace_update", lambda c: c.update_trace_settings(settings={"trace_rate": "1"}), "trace"),
    ("model_trace", lambda c: c.get_trace_settings(model_name="doubler"), "trace"),
    ("log", lambda c: c.get_log_settings(), "log"),
    ("log_update", lambda c: c.update_log_settings({"log_info": False}), "log"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "feature"), [c[1:] for c in HTTP_UNSERVED], ids=[c[0] for c in HTTP_UNSERVED]
)
def test_http_unserved_extension_is_501_naming_it(
    http: httpclient.InferenceServerClient,
    call: Callable[[httpclient.InferenceServerClient], Any],
    feature: str,
) -> None:
    # Triton answers a feature it does not support with TRITONSERVER_ERROR_UNSUPPORTED:
    # HTTP 501 (gRPC UNIMPLEMENTED, as carpool's gRPC face answers these RPCs).
    with pytest.raises(InferenceServerException) as caught:
        call(http)
    assert caught.value.status() == "501"
    assert f"{feature}" in caught.value.message()
    assert "not supported" in caught.value.message()
    assert _doubled(http.infer("doubler", [_row(httpclient, 1.0)])) == [[2.0, -2.0]]


def test_http_repository_index_lists_the_served_models(
    served: Served, http: httpclient.InferenceServerClient
) -> None:
    index = http.get_model_repository_index()
    assert sorted(index, key=lambda m: m["name"]) == [
        {"name": "doubler", "version": "1", "state": "READY", "reason": ""},
        {"name": "gated", "version": "1", "state": "READY", "reason": ""},
    ]
    url = f"http://{served.http_url}/v2/repository/index"
    assert httpx.post(url, json={"ready": True}, timeout=5).json() == index
    bad = httpx.post(url, content=b"[1]", timeout=5)
    assert bad.status_code == 400
    assert "'ready'" in bad.json()["error"]


SEQUENCES = [
    {"sequence_id": 7, "sequence_start": True},
    {"sequence_id": "session-1", "sequence_end": True},
    {"sequence_id": 7},
]
SEQUENCE_IDS = ["start", "end_string_id", "middle"]


@pytest.mark.parametrize("sequence", SEQUENCES, ids=SEQUENCE_IDS)
@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_sequence_request_is_refused_naming_the_extension(
    http: httpclient.InferenceServerClient,
    sequence: dict[str, Any],
    query: dict[str, str] | None,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        http.infer("doubler", [_row(httpclient, 1.0)], query_params=query, **sequence)
    assert caught.value.status() == "400"
    assert "sequence" in caught.value.message()
    assert "not supported" in caught.value.message()


@pytest.mark.parametrize("sequence", SEQUENCES, ids=SEQUENCE_IDS)
def test_grpc_sequence_request_is_refused_naming_the_extension(
    grpc: grpcclient.InferenceServerClient, sequence: dict[str, Any]
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("doubler", [_row(grpcclient, 1.0)], **sequence)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "sequence" in caught.value.message()


def test_grpc_sequence_request_on_a_stream_fails_alone(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    answers: Queue[tuple[Any, Any]] = Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        grpc.async_stream_infer("doubler", [_row(grpcclient, 1.0)], request_id="plain")
        grpc.async_stream_infer(
            "doubler", [_row(grpcclient, 1.0)], request_id="seq", sequence_id=3,
            sequence_start=True,
        )  # fmt: skip
        grpc.async_stream_infer("doubler", [_row(grpcclient, 2.0)], request_id="after")
        got = [answers.get(timeout=WAIT_LIMIT_S) for _ in range(3)]
    finally:
        grpc.stop_stream()
    (plain, none), (failed, error), (after, also_none) = got
    assert (none, also_none) == (None, None)
    assert (_doubled(plain), _doubled(after)) == ([[2.0, -2.0]], [[4.0, -2.0]])
    assert failed is None and "sequence" in error.message()


def test_sequence_id_zero_without_flags_means_no_sequence(served: Served) -> None:
    # The sequence extension: an id of 0 or "" says the request is not part of one.
    body = {
        "parameters": {"sequence_id": 0, "sequence_start": False, "sequence_end": False},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [2.0]}],
    }
    url = f"http://{served.http_url}/v2/models/doubler/infer"
    answer = httpx.post(url, json=body, timeout=WAIT_LIMIT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [4.0]


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_class_count_is_answered_as_top_classes(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    # The classification extension (tests/integration/test_classification.py in full).
    output = httpclient.InferRequestedOutput("OUTPUT0", class_count=2)
    result = http.infer("doubler", [_row(httpclient, 1.0)], outputs=[output], query_params=query)
    assert result.as_numpy("OUTPUT0").tolist() == [[b"2.000000:0", b"-2.000000:1"]]


def test_grpc_class_count_is_answered_as_top_classes(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    output = grpcclient.InferRequestedOutput("OUTPUT0", class_count=1)
    result = grpc.infer("doubler", [_row(grpcclient, 1.0)], outputs=[output])
    assert result.as_numpy("OUTPUT0").tolist() == [[b"2.000000:0"]]


@pytest.mark.parametrize("query", PATHS, ids=PATH_IDS)
def test_http_output_in_shared_memory_is_refused_naming_the_extension(
    http: httpclient.InferenceServerClient, query: dict[str, str] | None
) -> None:
    output = httpclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("region", 8)
    with pytest.raises(InferenceServerException) as caught:
        http.infer("doubler", [_row(httpclient, 1.0)], outputs=[output], query_params=query)
    assert caught.value.status() == "400"
    assert "shared memory" in caught.value.message()


def test_grpc_output_in_shared_memory_is_refused_naming_the_extension(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    output = grpcclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("region", 8)
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("doubler", [_row(grpcclient, 1.0)], outputs=[output])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "shared memory" in caught.value.message()


def test_listed_extensions_are_exactly_those_served(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    listed = set(http.get_server_metadata()["extensions"])
    assert listed == SERVED
    assert not listed & NOT_SERVED
    assert set(grpc.get_server_metadata().extensions) == SERVED - {"binary_tensor_data"}
