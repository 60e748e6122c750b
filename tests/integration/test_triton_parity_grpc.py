"""The gRPC face against what Triton's server does and ``tritonclient.grpc`` expects: stream
answers flagged final, answers over 64 MiB, unserved RPCs named, typed contents of every
datatype over the wire, Triton's reading of priority and timeout; and, marked xfail, where
carpool still differs from Triton."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from .conftest import ServedProcess, start_served_process, wait_until

WAIT_LIMIT_S = 30.0
BIG_OUTPUT_BYTES = 80 * 1024 * 1024  # over grpcio's and carpool's 64 MiB request limit
# Every datatype with a typed InferTensorContents field, the field and two values.
TYPED: dict[str, tuple[str, list[Any]]] = {
    "BOOL": ("bool_contents", [True, False]),
    "UINT8": ("uint_contents", [0, 255]),
    "UINT16": ("uint_contents", [1, 65535]),
    "UINT32": ("uint_contents", [1, 2**32 - 1]),
    "UINT64": ("uint64_contents", [1, 2**64 - 1]),
    "INT8": ("int_contents", [-128, 127]),
    "INT16": ("int_contents", [-32768, 32767]),
    "INT32": ("int_contents", [-(2**31), 2**31 - 1]),
    "INT64": ("int64_contents", [-(2**63), 2**63 - 1]),
    "FP32": ("fp32_contents", [1.5, -0.25]),
    "FP64": ("fp64_contents", [1e300, -2.5]),
    "BYTES": ("bytes_contents", [b"\x00\xff", b""]),
}
BIG_SOURCE = f"""\
import numpy as np


def big(inputs):
    return {{"Y": np.zeros((len(inputs["X"]), {BIG_OUTPUT_BYTES}), dtype=np.uint8)}}
"""


def _identity(datatype: str) -> str:
    return f"""\
  - name: id_{datatype}
    kind: python
    source: configmodels:identity
    inputs: [{{name: IN_{datatype}, datatype: {datatype}, shape: [-1]}}]
    outputs: [{{name: OUT_{datatype}, datatype: {datatype}, shape: [-1]}}]
    max_batch_size: 8
    max_delay_s: 0.001
"""


CONFIG = (
    "models:\n"
    + "".join(_identity(datatype) for datatype in TYPED)
    + """\
  - name: gated
    kind: python
    source: configmodels:gated
    inputs: [{name: X, datatype: INT64, shape: [1]}]
    outputs: [{name: Y, datatype: INT64, shape: [1]}]
    max_batch_size: 4
    max_delay_s: 0.001
  - name: big
    kind: python
    source: bigmodel:big
    inputs: [{name: X, datatype: UINT8, shape: [1]}]
    outputs: [{name: Y, datatype: UINT8, shape: [-1]}]
    max_batch_size: 1
"""
)


class Served:
    """The module's server and the gated model's files."""

    def __init__(self, process: ServedProcess, seen: Path, gate: Path) -> None:
        assert process.grpc_url is not None
        self.process = process
        self.grpc_url = process.grpc_url
        self.seen = seen
        self.gate = gate

    def seen_values(self) -> list[int]:
        return [int(v) for v in self.seen.read_text().split()] if self.seen.exists() else []

    def inference_count(self, model: str) -> int:
        url = f"http://{self.process.http_url}/v2/models/{model}/stats"
        return int(httpx.get(url, timeout=5).json()["model_stats"][0]["inference_count"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("grpc-review")
    (folder / "bigmodel.py").write_text(BIG_SOURCE, encoding="utf-8")
    seen, gate = folder / "seen.txt", folder / "gate"
    env = {"CARPOOL_TEST_SEEN": str(seen), "CARPOOL_TEST_GATE": str(gate)}
    process = start_served_process(CONFIG, folder, grpc=True, env=env)
    try:
        yield Served(process, seen, gate)
    finally:
        gate.unlink(missing_ok=True)
        assert process.stop() == 0, process.output()


@pytest.fixture
def client(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(served.grpc_url)
    yield client
    client.close()


@pytest.fixture
def stub(served: Served) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(served.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _fp32_input(value: float = 1.0) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN_FP32", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.full((1, 2), value, dtype=np.float32))
    return tensor


def _is_final(response: service_pb2.ModelInferResponse) -> bool:
    flag = response.parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


# -- stream answers say they are final -------------------------------------------------


def test_stream_answer_is_flagged_final_for_clients_that_wait_for_it(
    client: grpcclient.InferenceServerClient,
) -> None:
    # Triton sets parameters.triton_final_response on every stream answer; a client that
    # asks for enable_empty_final_response (PyTriton's, for one) reads answers until it
    # sees the flag, and would wait forever without it.
    answers: Queue[tuple[Any, Any]] = Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(
            "id_FP32", [_fp32_input()], request_id="f-1", enable_empty_final_response=True
        )
        result, error = answers.get(timeout=WAIT_LIMIT_S)
    finally:
        client.stop_stream()
    assert error is None, error
    response = result.get_response()
    assert response.id == "f-1"
    assert _is_final(response)


def test_stream_error_answer_is_flagged_final_and_names_the_request(
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
) -> None:
    bad = service_pb2.ModelInferRequest(model_name="nope", model_version="3", id="e-1")
    (answer,) = list(stub.ModelStreamInfer(iter([bad]), timeout=WAIT_LIMIT_S))
    assert "'nope' not found" in answer.error_message
    which = answer.infer_response
    assert (which.id, which.model_name, which.model_version) == ("e-1", "nope", "3")
    assert _is_final(which)


# -- message sizes ---------------------------------------------------------------------


def test_an_answer_over_64_mib_is_sent(client: grpcclient.InferenceServerClient) -> None:
    # Triton's server and tritonclient's channel allow messages up to 2 GiB; the answer
    # was refused with RESOURCE_EXHAUSTED ("Sent message larger than max") after the
    # model had run, while REST sent it.
    x = grpcclient.InferInput("X", [1, 1], "UINT8")
    x.set_data_from_numpy(np.zeros((1, 1), dtype=np.uint8))
    result = client.infer("big", [x], client_timeout=WAIT_LIMIT_S * 2)
    assert result.as_numpy("Y").shape == (1, BIG_OUTPUT_BYTES)


# -- statistics ------------------------------------------------------------------------


def test_statistics_carry_the_cache_durations_triton_always_writes(
    client: grpcclient.InferenceServerClient,
) -> None:
    client.infer("id_FP32", [_fp32_input()])
    (stats,) = client.get_inference_statistics("id_FP32").model_stats
    for name in ("cache_hit", "cache_miss"):
        assert stats.inference_stats.HasField(name), name
    as_json = client.get_inference_statistics("id_FP32", as_json=True)
    assert {"cache_hit", "cache_miss"} <= set(as_json["model_stats"][0]["inference_stats"])


# -- RPCs carpool does not serve -------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "rpc"),
    [
        (lambda c: c.load_model("id_FP32"), "RepositoryModelLoad"),
        (lambda c: c.get_system_shared_memory_status(), "SystemSharedMemoryStatus"),
        (lambda c: c.get_trace_settings(), "TraceSetting"),
    ],
    ids=["load_model", "shared_memory", "trace"],
)
def test_unserved_rpcs_are_unimplemented_naming_the_rpc(
    client: grpcclient.InferenceServerClient,
    call: Callable[[grpcclient.InferenceServerClient], Any],
    rpc: str,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call(client)
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert f"carpool does not serve {rpc}" in caught.value.message()


def test_unknown_services_keep_grpcs_own_answer(served: Served) -> None:
    with grpc.insecure_channel(served.grpc_url) as channel:
        call = channel.unary_unary("/other.Service/Method")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", timeout=WAIT_LIMIT_S)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- typed contents of every datatype, over the wire -----------------------------------


@pytest.mark.parametrize("datatype", list(TYPED))
def test_typed_contents_round_trip_as_raw_output(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, datatype: str
) -> None:
    field, values = TYPED[datatype]
    request = service_pb2.ModelInferRequest(model_name=f"id_{datatype}", id=f"t-{datatype}")
    tensor = request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[1, 2])
    getattr(tensor.contents, field).extend(values)
    response = stub.ModelInfer(request, timeout=WAIT_LIMIT_S)
    assert response.id == f"t-{datatype}"
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == (
        f"OUT_{datatype}",
        datatype,
        [1, 2],
    )
    assert len(response.raw_output_contents) == 1
    array = grpcclient.InferResult(response).as_numpy(f"OUT_{datatype}")
    assert array.ravel().tolist() == values


# -- request parameters as Triton reads them ------------------------------------------


def test_priority_above_the_levels_runs_at_the_default_level(
    client: grpcclient.InferenceServerClient,
) -> None:
    # Triton's InferenceRequest::SetPriority: 0 or a level beyond the model's is the
    # default level (fixed in repository.ServedModel.submit_options, shared with REST).
    result = client.infer("id_FP32", [_fp32_input()], priority=9)
    assert result.as_numpy("OUT_FP32").tolist() == [[1.0, 1.0]]


def test_timeout_zero_means_no_timeout(client: grpcclient.InferenceServerClient) -> None:
    # tritonserver.h: a timeout of 0 microseconds means the request has none of its own;
    # tritonclient sends timeout=0 as int64_param 0.
    result = client.infer("id_FP32", [_fp32_input()], timeout=0)
    assert result.as_numpy("OUT_FP32").tolist() == [[1.0, 1.0]]


# -- stream order, as Triton's for a model that is not decoupled ------------------------


def test_stream_answers_come_in_request_order(
    served: Served, client: grpcclient.InferenceServerClient
) -> None:
    answers: Queue[tuple[Any, Any]] = Queue()
    served.gate.touch()
    try:
        before = served.inference_count("id_FP32")
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        held = grpcclient.InferInput("X", [1, 1], "INT64")
        held.set_data_from_numpy(np.array([[7001]], dtype=np.int64))
        client.async_stream_infer("gated", [held], request_id="first")
        client.async_stream_infer("id_FP32", [_fp32_input()], request_id="second")
        wait_until(lambda: 7001 in served.seen_values(), "the first request to reach its model")
        wait_until(lambda: served.inference_count("id_FP32") > before, "the second to run")
    finally:
        served.gate.unlink(missing_ok=True)
    try:
        order = [answers.get(timeout=WAIT_LIMIT_S)[0].get_response().id for _ in range(2)]
    finally:
        client.stop_stream()
    assert order == ["first", "second"]
