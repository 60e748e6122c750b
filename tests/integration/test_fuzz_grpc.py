"""The gRPC port of one real `carpool serve` (the built-in models) fuzzed with hypothesis:
ModelInfer with random tensors (names, datatypes, shapes, typed contents, raw contents
that fit or do not, parameters of every kind, now and then a large one), the same on a
stream, every metadata, readiness, statistics and repository call with random names,
the calls of extensions carpool does not serve, and bytes that are not a protobuf or a
mutated valid request.

Properties, for every call: a result or a status that blames the request (INVALID_ARGUMENT,
NOT_FOUND, UNIMPLEMENTED, RESOURCE_EXHAUSTED, UNAVAILABLE), never INTERNAL, UNKNOWN or
DATA_LOSS, and an error always says what was wrong; a stream answers each request with a
result or an error message; after each property the server still answers its readiness
probe; over the module its RSS grows at most 50 MiB (flat, for all the large refused
calls). Examples per property: ``CARPOOL_FUZZ_EXAMPLES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from .fuzzing import (
    EMBEDDINGS,
    GENERATION,
    MLP,
    MODEL_NAMES,
    SETTINGS,
    Fuzzed,
    check_memory,
    fuzzed_server,
)

TIMEOUT_S = 60.0  # a net against a hang, never a timing assertion
SERVICE = "/inference.GRPCInferenceService"
BLAMES_THE_REQUEST = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES"]  # fmt: skip
LARGE_BYTES = (64 * 1024, 256 * 1024, 1024 * 1024)
INT64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(max_size=12)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    folder = tmp_path_factory.mktemp("fuzz-grpc")
    with fuzzed_server(folder, "test_fuzz_grpc", grpc=True) as server:
        yield server


@pytest.fixture(scope="module")
def channel(fuzzed: Fuzzed) -> Iterator[grpc.Channel]:
    assert fuzzed.process.grpc_url is not None
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(fuzzed.process.grpc_url, options=unlimited) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(3):  # the first calls allocate for good: not growth fuzzing caused
            stub.ModelInfer(_mlp_request(np.zeros((2, 256), dtype="<f4").tobytes(), 2))
        fuzzed.log.rss_start_kib = fuzzed.rss_kib()
        yield channel


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> service_pb2_grpc.GRPCInferenceServiceStub:
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(autouse=True)
def _still_serving(fuzzed: Fuzzed) -> Iterator[None]:
    yield
    fuzzed.check_alive()


def _mlp_request(raw: bytes, rows: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MLP)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 256])
    request.raw_input_contents.append(raw)
    return request


def _call(fuzzed: Fuzzed, method: Any, request: Any, what: str) -> Any:
    """One unary call: its answer, or None when it was refused for a reason the status
    and its details give."""
    try:
        answer = method(request, timeout=TIMEOUT_S)
        fuzzed.log.saw("OK", what, is_fault=False)
        return answer
    except grpc.RpcError as error:
        code, details = error.code(), error.details()
    sent = f"{what} -> {details}"
    assert fuzzed.log.saw(code.name, sent, is_fault=code in SERVER_FAULTS), f"{code}: {sent}"
    assert code in BLAMES_THE_REQUEST, f"{code}: {sent}"
    assert details, f"{code} without details: {what}"
    return None


# -- requests ---------------------------------------------------------------------------

PARAMETERS = st.dictionaries(
    st.sampled_from(["timeout", "priority", "binary_data_output", "sequence_id"]) | TEXT,
    st.one_of(
        st.builds(lambda v: pb.InferParameter(bool_param=v), st.booleans()),
        st.builds(lambda v: pb.InferParameter(int64_param=v), INT64),
        st.builds(lambda v: pb.InferParameter(string_param=v), TEXT),
        st.builds(lambda v: pb.InferParameter(double_param=v), st.floats()),
        st.builds(lambda v: pb.InferParameter(uint64_param=v), st.integers(0, 2**64 - 1)),
    ),
    max_size=3,
)
CONTENTS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": INT64,
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=8),
}
ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "FP16": 2, "BF16": 2, "UINT16": 2, "INT16": 2,
              "FP64": 8, "INT64": 8, "UINT64": 8}  # fmt: skip


def _size(shape: list[int]) -> int | None:
    if any(d < 0 for d in shape):
        return None
    size = int(np.prod(shape, dtype=object)) if shape else 1
    return size if size <= 4096 else None


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """Half close to mlp's (INPUT0 FP32 [n, 256], raw), half anything; each field may be
    off; now and then one raw content of 64 KiB to 1 MiB (a leak of refused calls shows)."""
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from([MLP, MLP, EMBEDDINGS, GENERATION]) | MODEL_NAMES),
        model_version=draw(st.sampled_from(["", "1"]) | TEXT),
        id=draw(TEXT),
    )
    for key, value in draw(PARAMETERS).items():
        request.parameters[key].CopyFrom(value)
    is_raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            name, datatype, shape = "INPUT0", "FP32", [draw(st.integers(0, 3)), 256]
        else:
            name = draw(st.sampled_from(["INPUT0", ""]) | TEXT)
            datatype = draw(st.sampled_from(DATATYPES) | TEXT)
            shape = draw(st.lists(st.integers(-2, 5) | INT64, max_size=4))
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        for key, value in draw(PARAMETERS).items():
            tensor.parameters[key].CopyFrom(value)
        size = _size(shape)
        if is_raw:
            fit = size * ITEM_BYTES.get(datatype, 4) if size is not None else None
            if fit is not None and draw(st.integers(0, 3)):
                raw = draw(st.binary(min_size=fit, max_size=fit))
            elif draw(st.integers(0, 5)) == 0:
                raw = b"\x01" * draw(st.sampled_from(LARGE_BYTES))
            else:
                raw = draw(st.binary(max_size=64))
            request.raw_input_contents.append(raw)
        elif draw(st.integers(0, 4)):
            field = draw(st.sampled_from(sorted(CONTENTS)))
            count = size if size is not None and draw(st.booleans()) else draw(st.integers(0, 8))
            values = draw(st.lists(CONTENTS[field], min_size=count, max_size=count))
            getattr(tensor.contents, field).extend(values)
    if draw(st.integers(0, 5)) == 0:  # raw contents with no input, or one too many
        request.raw_input_contents.append(draw(st.binary(max_size=16)))
    for _ in range(draw(st.integers(0, 2))):
        output = request.outputs.add(name=draw(st.sampled_from(["OUTPUT0", ""]) | TEXT))
        for key, value in draw(PARAMETERS).items():
            output.parameters[key].CopyFrom(value)
    return request


def _describe(request: pb.ModelInferRequest) -> str:
    inputs = [(t.name, t.datatype, list(t.shape)) for t in request.inputs]
    sizes = [len(raw) for raw in request.raw_input_contents]
    return f"model {request.model_name!r} v{request.model_version!r} inputs {inputs} raw {sizes}"


@SETTINGS
@given(request=infer_requests())
def test_model_infer_is_a_result_or_a_status_that_blames_the_request(
    fuzzed: Fuzzed, stub: service_pb2_grpc.GRPCInferenceServiceStub, request: Any
) -> None:
    answer = _call(fuzzed, stub.ModelInfer, request, _describe(request))
    if answer is not None:
        assert answer.model_name == request.model_name


@SETTINGS
@given(requests=st.lists(infer_requests(), min_size=1, max_size=3))
def test_a_stream_answers_each_request_with_a_result_or_an_error(
    fuzzed: Fuzzed, stub: service_pb2_grpc.GRPCInferenceServiceStub, requests: list[Any]
) -> None:
    what = "; ".join(_describe(r) for r in requests)
    try:
        answers = list(stub.ModelStreamInfer(iter(requests), timeout=TIMEOUT_S))
    except grpc.RpcError as error:  # the stream itself refused (a message over the limit)
        code = error.code()
        assert fuzzed.log.saw(code.name, what, is_fault=code in SERVER_FAULTS), what
        assert code in BLAMES_THE_REQUEST, (code, error.details(), what)
        return
    assert len(answers) == len(requests), what
    for answer in answers:
        is_error = bool(answer.error_message)
        fuzzed.log.saw("stream error" if is_error else "OK", what, is_fault=False)
        assert is_error or answer.infer_response.model_name, what
        assert "internal error" not in answer.error_message, (answer.error_message, what)


# -- metadata, readiness, statistics, repository, extensions ----------------------------

NAME_VERSION = st.tuples(
    st.sampled_from([MLP, EMBEDDINGS, GENERATION]) | MODEL_NAMES,
    st.sampled_from(["", "1"]) | TEXT,
)
METADATA_CALLS = st.one_of(
    st.just(("ServerLive", pb.ServerLiveRequest())),
    st.just(("ServerReady", pb.ServerReadyRequest())),
    st.just(("ServerMetadata", pb.ServerMetadataRequest())),
    *(
        st.builds(lambda nv, m=method, k=kind: (m, k(name=nv[0], version=nv[1])), NAME_VERSION)
        for method, kind in [
            ("ModelReady", pb.ModelReadyRequest),
            ("ModelMetadata", pb.ModelMetadataRequest),
            ("ModelConfig", pb.ModelConfigRequest),
            ("ModelStatistics", pb.ModelStatisticsRequest),
        ]
    ),
    st.builds(
        lambda name, ready: (
            "RepositoryIndex",
            pb.RepositoryIndexRequest(repository_name=name, ready=ready),
        ),
        TEXT,
        st.booleans(),
    ),
    st.builds(
        lambda name: ("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=name)), TEXT
    ),
    st.builds(
        lambda name: ("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=name)),
        TEXT,
    ),
    st.builds(
        lambda name: ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=name)),
        TEXT,
    ),
    st.builds(
        lambda name: ("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(name=name)),
        TEXT,
    ),
    st.builds(lambda name: ("TraceSetting", pb.TraceSettingRequest(model_name=name)), TEXT),
    st.just(("LogSettings", pb.LogSettingsRequest())),
)


@SETTINGS
@given(call=METADATA_CALLS)
def test_every_other_call_is_an_answer_or_a_status_that_blames_the_request(
    fuzzed: Fuzzed, stub: service_pb2_grpc.GRPCInferenceServiceStub, call: tuple[str, Any]
) -> None:
    method, request = call
    _call(fuzzed, getattr(stub, method), request, f"{method} {str(request)[:200]!r}")


# -- bytes that are not what they claim -------------------------------------------------

RAW_METHODS = ["ModelInfer", "ModelInfer", "ModelMetadata", "ModelReady", "ServerMetadata",
               "ModelStatistics"]  # fmt: skip
VALID = _mlp_request(np.ones((1, 256), dtype="<f4").tobytes(), 1).SerializeToString()


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request's bytes with a few bytes flipped, inserted, cut or repeated."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "insert", "cut", "repeat"]))
        if kind == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "cut":
            del data[at : at + draw(st.integers(1, 64))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


@SETTINGS
@given(method=st.sampled_from(RAW_METHODS), data=st.binary(max_size=256) | mutated())
def test_bytes_that_are_not_a_valid_message_are_refused_as_such(
    fuzzed: Fuzzed, channel: grpc.Channel, method: str, data: bytes
) -> None:
    call = channel.unary_unary(
        f"{SERVICE}/{method}", request_serializer=bytes, response_deserializer=bytes
    )
    _call(fuzzed, call, data, f"{method} {data[:200]!r}")


def test_memory_grew_at_most_50_mib_over_the_module(fuzzed: Fuzzed, channel: grpc.Channel) -> None:
    check_memory(fuzzed)  # since the channel's warm-up
