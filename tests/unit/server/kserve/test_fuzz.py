"""The KServe v2 codec fuzzed on both wires: request bodies built by Triton's own clients,
decoded by the server, and answers decoded by the same clients; then mutated bodies and
random gRPC messages, which must be refused as the client's fault (a 4xx naming what was
wrong).

Properties:

* round trip: for every datatype, random shapes (zero-size dimensions, scalars, models
  declared with -1) and values (NaN, infinities, -0.0, integer extremes, empty and
  non-UTF-8 BYTES), sent by ``tritonclient.http`` as JSON or binary (chosen per input) or
  by ``tritonclient.grpc``, the model receives exactly what the client meant; what the
  model returns, asked for as binary or JSON per output, decodes with ``tritonclient``'s
  ``InferResult`` to the model's output (BF16 rounded as ``ml_dtypes`` rounds it);
* robustness: a mutated body (truncated, flipped bytes, a wrong header length, a wrong
  ``binary_data_size``, huge or negative shapes, deep nesting, duplicates, unknown
  datatypes, non-objects) is either a valid request or an error that ``http_error`` maps
  to a 4xx with a message; a huge declared shape allocates nothing; the same for random
  ``ModelInferRequest`` messages;
* the plan cache: requests sharing a header never share data, a cached header with a
  body of another length is refused, and options follow the model's policy.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc._utils import _get_inference_request as grpc_request_of
from tritonclient.http._infer_result import InferResult
from tritonclient.http._utils import _get_inference_request as http_request_of

from carpool import Batcher, ClassPolicy
from carpool.errors import InvalidInput
from carpool.server.errors import http_error
from carpool.server.kserve import grpc_codec
from carpool.server.kserve.rest import InferPlans, infer_response, prepare_infer
from carpool.server.kserve.rest_decode import decode_infer_request
from carpool.server.kserve.tensors import DATATYPES, serialize_bytes_tensor
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import ServedModel, TensorSpec

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = list(DATATYPES)
FLOAT_BITS = {"FP16": np.uint16, "FP32": np.uint32, "FP64": np.uint64, "BF16": np.uint32}


# ---------------------------------------------------------------------------------------
# Values


def _elements(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":  # empty, non-UTF-8, and text that JSON can carry
        return st.one_of(st.binary(max_size=6), st.text(max_size=4).map(str.encode))
    if datatype == "BF16":  # every bit pattern: NaNs with payloads, infinities, subnormals
        return st.integers(0, 0xFFFF)
    if datatype.startswith("FP"):
        return st.floats(width={"FP16": 16, "FP32": 32, "FP64": 64}[datatype])
    limits = np.iinfo(DATATYPES[datatype])
    extremes = [int(limits.min), int(limits.max), 0, 1, *([-1] if limits.min else [])]
    return st.one_of(st.sampled_from(extremes), st.integers(int(limits.min), int(limits.max)))


def _array_of(datatype: str, shape: tuple[int, ...], values: list[Any]) -> np.ndarray:
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    elif datatype == "BF16":  # what tritonclient sends for BF16: float32 it truncates
        array = (np.array(values, dtype=np.uint32) << 16).view(np.float32)
    else:
        array = np.array(values, dtype=DATATYPES[datatype])
    return array.reshape(shape)


@st.composite
def arrays(draw: st.DrawFn, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)
    return _array_of(
        datatype, shape, draw(st.lists(_elements(datatype), min_size=count, max_size=count))
    )


def shapes(*, min_rank: int = 0, max_rank: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, 3), min_size=min_rank, max_size=max_rank).map(tuple)


def _is_utf8(array: np.ndarray) -> bool:
    try:
        for element in array.ravel().tolist():
            element.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _assert_same(datatype: str, got: np.ndarray, expected: np.ndarray, where: str) -> None:
    """Equal shape and values; floats bit for bit but for NaN payloads (JSON has one NaN)."""
    assert tuple(got.shape) == tuple(expected.shape), f"{where}: shape {got.shape}"
    if datatype == "BYTES":
        assert got.ravel().tolist() == expected.ravel().tolist(), where
        return
    got, expected = got.ravel(), expected.ravel()
    if datatype in FLOAT_BITS:
        bits = FLOAT_BITS[datatype]
        is_nan = np.isnan(expected)
        assert np.array_equal(np.isnan(got), is_nan), f"{where}: {got} vs {expected}"
        assert np.array_equal(got[~is_nan].view(bits), expected[~is_nan].view(bits)), (
            f"{where}: {got} vs {expected}"
        )
    else:
        assert np.array_equal(got, expected), f"{where}: {got} vs {expected}"


def _assert_received(datatype: str, got: np.ndarray, sent: np.ndarray, where: str) -> None:
    assert got.dtype == DATATYPES[datatype], f"{where}: dtype {got.dtype}"
    assert got.flags.writeable, f"{where}: read-only"
    _assert_same(datatype, got, sent, where)


# ---------------------------------------------------------------------------------------
# Requests as Triton's clients build them


@dataclass(frozen=True)
class Sent:
    """One input as the client means it."""

    name: str
    datatype: str
    array: np.ndarray
    is_binary: bool


@st.composite
def sent_inputs(draw: st.DrawFn, *, batch: int | None = None, max_inputs: int = 3) -> list[Sent]:
    """Inputs of any datatype; with ``batch``, each has it as its first dimension."""
    sent = []
    for index in range(draw(st.integers(1, max_inputs))):
        datatype = draw(st.sampled_from(NAMES))
        shape = draw(shapes()) if batch is None else (batch, *draw(shapes(max_rank=2)))
        array = draw(arrays(datatype, shape))
        # BF16 travels only as binary; JSON BYTES only when UTF-8 (tritonclient refuses).
        can_json = datatype != "BF16" and (datatype != "BYTES" or _is_utf8(array))
        is_binary = draw(st.booleans()) if can_json else True
        sent.append(Sent(f"in{index}", datatype, array, is_binary))
    return sent


def http_body(
    sent: list[Sent], outputs: list[tuple[str, bool]] | None = None, request_id: str = ""
) -> tuple[bytes, bytes | None]:
    """(body, Inference-Header-Content-Length) as ``tritonclient.http`` sends them."""
    inputs = []
    for item in sent:
        infer_input = httpclient.InferInput(item.name, list(item.array.shape), item.datatype)
        infer_input.set_data_from_numpy(item.array, binary_data=item.is_binary)
        inputs.append(infer_input)
    requested = [httpclient.InferRequestedOutput(n, binary_data=b) for n, b in outputs or []]
    body, json_size = http_request_of(
        inputs, request_id, requested or None, 0, False, False, 0, None, None
    )
    return body, None if json_size is None else str(json_size).encode()


def served(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> ServedModel:
    return ServedModel("fuzz", "1", "python", tuple(inputs), tuple(outputs), Batcher(lambda x: x))


def _declared(draw: st.DrawFn, sent: Sent) -> TensorSpec:
    """The model's spec of ``sent``: its shape without the batch dimension, some dims -1."""
    dims = [draw(st.sampled_from([dim, -1])) for dim in sent.array.shape[1:]]
    return TensorSpec(sent.name, sent.datatype, tuple(dims))


# ---------------------------------------------------------------------------------------
# 1. Round trips


@SETTINGS
@given(sent=sent_inputs(max_inputs=4))
def test_the_decoder_gives_what_tritonclient_http_meant(sent: list[Sent]) -> None:
    body, header_length = http_body(sent)
    length = None if header_length is None else int(header_length)
    request = decode_infer_request(body, length)
    assert [t.name for t in request.inputs] == [s.name for s in sent]
    for tensor, item in zip(request.inputs, sent, strict=True):
        assert tensor.datatype == item.datatype and tensor.shape == item.array.shape
        _assert_received(item.datatype, tensor.array, item.array, f"input {item.name}")


@dataclass(frozen=True)
class Returned:
    """One model output, and how (or whether) the client asked for it."""

    spec: TensorSpec
    array: np.ndarray
    is_binary: bool


@st.composite
def model_outputs(draw: st.DrawFn) -> list[Returned]:
    returned = []
    for index in range(draw(st.integers(1, 3))):
        datatype = draw(st.sampled_from(NAMES))
        shape = draw(shapes(min_rank=1))
        if datatype == "BF16":  # any float32 the model computes; the server rounds it
            bits = draw(
                st.lists(
                    st.integers(0, 2**32 - 1), min_size=math.prod(shape), max_size=math.prod(shape)
                )
            )
            array = np.array(bits, dtype=np.uint32).view(np.float32).reshape(shape)
        else:
            array = draw(arrays(datatype, shape))
        spec = TensorSpec(f"out{index}", datatype, (-1,))
        returned.append(Returned(spec, array, draw(st.booleans())))
    return returned


def _expected_output(item: Returned) -> np.ndarray:
    if item.spec.datatype == "BF16":  # round to nearest even, as ml_dtypes does
        rounded = item.array.astype(ml_dtypes.bfloat16).astype(np.float32)
        return rounded
    if item.spec.datatype == "BYTES" and not item.is_binary:  # JSON gives back strings
        return np.array([e.decode() for e in item.array.ravel().tolist()], dtype=object).reshape(
            item.array.shape
        )
    return item.array


def _refusal(item: Returned) -> str | None:
    """Why the server must refuse to answer ``item`` as asked, if it must."""
    if item.is_binary:
        return None
    if item.spec.datatype == "BF16":
        return "BF16 can only be returned as binary"
    if item.spec.datatype == "BYTES" and not _is_utf8(item.array):
        return "not valid UTF-8"
    return None


def _client_result(answer: tuple[int, bytes, Any]) -> InferResult:
    status, body, headers = answer
    assert status == 200
    length = dict(headers).get(b"inference-header-content-length")
    return InferResult.from_response_body(body, header_length=length and int(length))


@SETTINGS
@given(data=st.data(), batch=st.integers(1, 3), name_outputs=st.booleans())
def test_a_model_gets_what_the_client_meant_and_the_client_what_the_model_returned(
    data: st.DataObject, batch: int, name_outputs: bool
) -> None:
    sent = data.draw(sent_inputs(batch=batch))
    returned = data.draw(model_outputs())
    model = served([_declared(data.draw, s) for s in sent], [r.spec for r in returned])
    if not name_outputs:  # tritonclient then asks for every output as binary
        returned = [Returned(r.spec, r.array, True) for r in returned]
    outputs = [(r.spec.name, r.is_binary) for r in returned] if name_outputs else None
    plans = InferPlans()
    # Twice with the same shapes and other data: the second goes through the plan.
    for attempt in range(2):
        if attempt:
            sent = [
                Sent(s.name, s.datatype, data.draw(arrays(s.datatype, s.array.shape)), s.is_binary)
                for s in sent
            ]
            sent = [
                s
                if s.is_binary or s.datatype != "BYTES" or _is_utf8(s.array)
                else Sent(s.name, s.datatype, s.array, True)
                for s in sent
            ]
        call = prepare_infer(model, *http_body(sent, outputs, request_id="r"), plans)
        for item in sent:
            _assert_received(item.datatype, call.payload[item.name], item.array, item.name)
        result = {r.spec.name: r.array for r in returned}
        refusals = [why for r in returned if (why := _refusal(r))]
        if refusals:
            with pytest.raises(InvalidInput, match=refusals[0]):
                infer_response(model, call, result)
            continue
        answer = _client_result(infer_response(model, call, result))
        assert answer.get_response()["id"] == "r"
        for item in returned:
            got = answer.as_numpy(item.spec.name)
            expected = _expected_output(item)
            if expected.size == 0:  # tritonclient gives np.empty(0) whatever the type
                assert got.shape == expected.shape
            else:
                _assert_same(item.spec.datatype, got, expected, f"output {item.spec.name}")


def _grpc_contents(request: pb.ModelInferRequest, sent: list[Sent]) -> None:
    """Move the raw contents into the typed ``contents`` fields, as other clients send."""
    del request.raw_input_contents[:]
    for tensor, item in zip(request.inputs, sent, strict=True):
        field = getattr(tensor.contents, CONTENTS_FIELD[item.datatype])
        field.extend(item.array.ravel().tolist())


@SETTINGS
@given(data=st.data(), is_typed=st.booleans())
def test_grpc_round_trips_what_tritonclient_grpc_sends_and_reads(
    data: st.DataObject, is_typed: bool
) -> None:
    sent = data.draw(sent_inputs(max_inputs=4))
    inputs = []
    for item in sent:
        infer_input = grpcclient.InferInput(item.name, list(item.array.shape), item.datatype)
        infer_input.set_data_from_numpy(item.array)
        inputs.append(infer_input)
    wire = grpc_request_of("m", inputs, "", "r", None, 0, False, False, 0, None, None)
    request = pb.ModelInferRequest.FromString(wire.SerializeToString())
    if is_typed and all(s.datatype not in ("FP16", "BF16") for s in sent):
        _grpc_contents(request, sent)
    decoded = grpc_codec.decode_infer_request(request)
    for tensor, item in zip(decoded.inputs, sent, strict=True):
        _assert_received(item.datatype, tensor.array, item.array, f"input {item.name}")

    returned = data.draw(model_outputs())
    model = served([], [r.spec for r in returned])
    response = grpc_codec.encode_infer_response(
        model, "r", [r.spec for r in returned], {r.spec.name: r.array for r in returned}
    )
    answer = grpcclient.InferResult(
        triton_pb.ModelInferResponse.FromString(response.SerializeToString())
    )
    for item in returned:
        expected = _expected_output(Returned(item.spec, item.array, True))
        got = answer.as_numpy(item.spec.name)
        if expected.size == 0:
            assert got.shape == expected.shape
        else:
            _assert_same(item.spec.datatype, got, expected, f"output {item.spec.name}")


# ---------------------------------------------------------------------------------------
# 2. Robustness


def _assert_client_error(exc: Exception) -> None:
    error = http_error(exc)
    assert 400 <= error.status < 500, f"{type(exc).__name__}: {exc} answered {error.status}"
    assert isinstance(exc, InvalidInput), f"{type(exc).__name__}: {exc}"
    assert len(str(exc)) > 10, f"{type(exc).__name__} without a message: {exc!r}"


# Shapes that no body can fill, or that no array can have.
ODD_DIMS = [-1, -(2**63), 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 1.5, True, "2", None]
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _nested(depth: int) -> Any:
    value: Any = [1.0]
    for _ in range(depth):
        value = [value]
    return value


EDITS = [
    "binary_data_size",
    "shape",
    "huge-shape",
    "datatype",
    "duplicate",
    "drop",
    "unknown",
    "data",
    "deep-data",
    "deep-parameters",
    "non-object",
    "outputs",
    "request-field",
    "input-field",
]


def _edit_document(draw: st.DrawFn, document: dict[str, Any]) -> Any:
    """``document`` with one random edit of its structure."""
    inputs = document["inputs"]
    entry = inputs[draw(st.integers(0, len(inputs) - 1))]
    parameters = entry.setdefault("parameters", {})
    edit = draw(st.sampled_from(EDITS))
    if edit == "binary_data_size":
        parameters["binary_data_size"] = draw(st.one_of(ODD_VALUES, st.integers(-8, 2**40)))
    elif edit == "shape":
        entry["shape"] = draw(
            st.one_of(ODD_VALUES, st.lists(st.sampled_from(ODD_DIMS), max_size=3))
        )
    elif edit == "huge-shape":  # a shape that would take terabytes, maybe with a zero
        entry["shape"] = draw(
            st.lists(st.sampled_from([0, 1, 2**20, 2**40, 2**62]), min_size=1, max_size=4)
        )
    elif edit == "datatype":
        entry["datatype"] = draw(st.one_of(ODD_VALUES, st.sampled_from(["FP8", "fp32", "STRING"])))
    elif edit == "duplicate":
        inputs.append(dict(entry))
    elif edit == "drop":
        inputs.remove(entry)
    elif edit == "unknown":
        inputs.append({**entry, "name": "nope"})
    elif edit == "data":
        parameters.pop("binary_data_size", None)
        entry["data"] = draw(st.one_of(ODD_VALUES, st.lists(ODD_VALUES, max_size=4)))
    elif edit == "deep-data":
        parameters.pop("binary_data_size", None)
        entry["data"] = _nested(draw(st.sampled_from([40, 70, 300, 1100])))
    elif edit == "deep-parameters":
        document.setdefault("parameters", {})["x"] = _nested(draw(st.sampled_from([300, 1100])))
    elif edit == "non-object":
        return draw(st.one_of(ODD_VALUES, st.just([document])))
    elif edit == "outputs":
        document["outputs"] = draw(
            st.one_of(
                ODD_VALUES,
                st.lists(ODD_VALUES, max_size=2),
                st.just([{"name": "y", "parameters": {"binary_data": 1}}]),
                st.just([{"name": "y"}] * 2),
            )
        )
    elif edit == "request-field":
        key = draw(st.sampled_from(["id", "parameters", "inputs"]))
        document[key] = draw(ODD_VALUES)
    else:
        entry[draw(st.sampled_from(["name", "parameters"]))] = draw(ODD_VALUES)
    return document


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    """A valid body of ``ROBUST_MODEL`` as tritonclient builds it, then one mutation."""
    batch = draw(st.integers(1, 2))
    sent = []
    for spec in ROBUST_MODEL.inputs:
        shape = (batch, *[d if d >= 0 else draw(st.integers(0, 2)) for d in spec.shape])
        array = draw(arrays(spec.datatype, shape))
        can_json = spec.datatype != "BYTES" or _is_utf8(array)
        sent.append(Sent(spec.name, spec.datatype, array, draw(st.booleans()) or not can_json))
    body, header_length = http_body(sent, draw(st.sampled_from([None, [("y", True)]])))
    length = len(body) if header_length is None else int(header_length)
    kind = draw(st.sampled_from(["none", "truncate", "extend", "flip", "length", "edit"]))
    if kind == "truncate":
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    elif kind == "extend":
        body += draw(st.binary(min_size=1, max_size=9))
    elif kind == "flip":
        at = draw(st.integers(0, max(0, length - 1)))
        body = body[:at] + bytes([body[at] ^ draw(st.integers(1, 255))]) + body[at + 1 :]
    elif kind == "length":
        header_length = draw(
            st.one_of(
                st.integers(-3, len(body) + 3).map(lambda n: str(n).encode()),
                st.sampled_from([b"", b"x", b"1e3", b" 12", b"0x1f", b"9" * 5000, b"\xff"]),
            )
        )
    else:
        document = _edit_document(draw, json.loads(body[:length]))  # rapidjson wrote NaN
        try:
            header = json.dumps(document).encode()
        except RecursionError:
            header = b"[" * 5000
        body = header + body[length:]
        header_length = None if header_length is None else str(len(header)).encode()
    return body, header_length


ROBUST_MODEL = served(
    [TensorSpec("a", "FP32", (2,)), TensorSpec("b", "BYTES", (-1,)), TensorSpec("c", "INT8", ())],
    [TensorSpec("y", "FP32", (-1,))],
)
ROBUST_PLANS = InferPlans()  # shared by the examples: mutations also meet cached plans


@settings(SETTINGS, max_examples=400)
@given(mutated=mutated_bodies())
def test_a_mutated_body_is_a_valid_request_or_a_400_naming_the_problem(
    mutated: tuple[bytes, bytes | None],
) -> None:
    body, header_length = mutated
    try:
        call = prepare_infer(ROBUST_MODEL, body, header_length, ROBUST_PLANS)
    except Exception as exc:
        _assert_client_error(exc)
        return
    specs = {spec.name: spec for spec in ROBUST_MODEL.inputs}
    for name, array in call.payload.items():  # what the model gets, planned or not
        assert specs[name].accepts(array.shape), (name, array.shape)
        assert array.dtype == DATATYPES[specs[name].datatype]


@st.composite
def huge_shape_bodies(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A body declaring a shape of up to 2**64 - 1 per dimension (maybe with a zero),
    with a few bytes of data or a few JSON values."""
    datatype = draw(st.sampled_from(NAMES))
    shape = draw(
        st.lists(
            st.sampled_from([0, 1, 3, 2**31, 2**40, 2**62, 2**63 - 1, 2**64 - 1]),
            min_size=1,
            max_size=3,
        )
    )
    entry: dict[str, Any] = {"name": "x", "datatype": datatype, "shape": shape}
    if draw(st.booleans()):
        data = draw(st.binary(max_size=12))
        entry["parameters"] = {"binary_data_size": draw(st.sampled_from([len(data), 2**40]))}
        header = orjson.dumps({"inputs": [entry]})
        return header + data, len(header)
    entry["data"] = draw(st.lists(st.sampled_from(["a", 1, 0.5, True]), max_size=3))
    return orjson.dumps({"inputs": [entry]}), None


@settings(SETTINGS, max_examples=150)
@given(huge=huge_shape_bodies())
def test_a_huge_declared_shape_is_refused_before_anything_is_allocated(
    huge: tuple[bytes, int | None],
) -> None:
    body, length = huge
    tracemalloc.start()
    try:
        decode_infer_request(body, length)
    except Exception as exc:
        _assert_client_error(exc)
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak_bytes < 1_000_000, f"decoding {len(body)} bytes peaked at {peak_bytes} bytes"


def test_a_zero_size_tensor_with_huge_dimensions_is_a_400() -> None:
    """Was: shape [0, 2**63] (no elements, so no data to disagree with) passed every check
    and NumPy's reshape then raised ValueError ("Maximum allowed dimension exceeded"), a
    500; over gRPC too, with [0, 2**62, 2**62] ("array is too big")."""
    for shape in ([0, 2**63], [0, 2**62, 2**62]):
        for binary in (False, True):
            entry: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": shape}
            if binary:
                entry["parameters"] = {"binary_data_size": 0}
            else:
                entry["data"] = []
            header = orjson.dumps({"inputs": [entry]})
            with pytest.raises(InvalidInput, match="shape"):
                decode_infer_request(header, len(header) if binary else None)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="BYTES", shape=[0, 2**62, 2**62])
    request.raw_input_contents.append(b"")
    with pytest.raises(InvalidInput, match="shape"):
        grpc_codec.decode_infer_request(request)


# The InferTensorContents field of each datatype in Triton's grpc_service.proto.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    **dict.fromkeys(["INT8", "INT16", "INT32"], "int_contents"),
    "INT64": "int64_contents",
    **dict.fromkeys(["UINT8", "UINT16", "UINT32"], "uint_contents"),
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
GRPC_DIMS = [-1, 0, 1, 2, 3, 2**31, 2**62, 2**63 - 1, -(2**63)]
CONTENT_VALUES = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=4),
}


@st.composite
def grpc_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id=draw(st.sampled_from(["", "r"])))
    num_inputs = draw(st.integers(0, 3))
    raw = []
    for _ in range(num_inputs):
        datatype = draw(st.one_of(st.sampled_from(NAMES), st.sampled_from(["", "FP8", "int8"])))
        shape = draw(st.lists(st.one_of(st.integers(0, 3), st.sampled_from(GRPC_DIMS)), max_size=3))
        tensor = request.inputs.add(
            name=draw(st.sampled_from(["a", "b", "c"])), datatype=datatype, shape=shape
        )
        if draw(st.integers(0, 9)) == 0:
            tensor.parameters["shared_memory_region"].string_param = "r"
        count = math.prod(shape) if all(0 <= d <= 3 for d in shape) else draw(st.integers(0, 4))
        if draw(st.booleans()):
            field = draw(
                st.one_of(
                    st.just(CONTENTS_FIELD.get(datatype, "fp32_contents")),
                    st.sampled_from(sorted(CONTENT_VALUES)),
                )
            )
            count = draw(st.sampled_from([count, max(0, count - 1), count + 1]))
            values = draw(st.lists(CONTENT_VALUES[field], min_size=count, max_size=count))
            getattr(tensor.contents, field).extend(values)
        if datatype == "BYTES":
            elements = np.empty(count, dtype=object)
            elements[:] = draw(st.lists(st.binary(max_size=3), min_size=count, max_size=count))
            chunk = serialize_bytes_tensor(elements)
        else:
            itemsize = 2 if datatype == "BF16" else DATATYPES.get(datatype, np.dtype("u1")).itemsize
            chunk = draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
        raw.append(draw(st.one_of(st.just(chunk), st.binary(max_size=9))))
    if draw(st.booleans()):
        request.raw_input_contents.extend(raw[: draw(st.integers(0, len(raw) + 1))])
    for name in draw(st.lists(st.sampled_from(["y", "z"]), max_size=3)):
        output = request.outputs.add(name=name)
        if draw(st.booleans()):
            output.parameters["classification"].int64_param = draw(st.integers(0, 2))
    return request


@settings(SETTINGS, max_examples=300)
@given(request=grpc_requests())
def test_a_random_grpc_request_decodes_or_is_invalid_input(request: pb.ModelInferRequest) -> None:
    tracemalloc.start()
    try:
        decoded = grpc_codec.decode_infer_request(request)
    except Exception as exc:
        _assert_client_error(exc)
        return
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak_bytes < 1_000_000, f"decoding peaked at {peak_bytes} bytes"
    for tensor in decoded.inputs:
        assert tensor.array.shape == tensor.shape
        assert tensor.array.dtype == DATATYPES[tensor.datatype]


# ---------------------------------------------------------------------------------------
# 3. The plan cache


PLAN_MODEL = served(
    [TensorSpec("a", "FP32", (2,)), TensorSpec("b", "INT16", (-1,))],
    [TensorSpec("y", "FP32", (-1,))],
)


@st.composite
def same_header_requests(draw: st.DrawFn) -> list[list[Sent]]:
    """Binary requests of one shape, so one header, each with its own data."""
    batch, width = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    requests = []
    for _ in range(draw(st.integers(2, 4))):
        requests.append(
            [
                Sent("a", "FP32", draw(arrays("FP32", (batch, 2))), True),
                Sent("b", "INT16", draw(arrays("INT16", (batch, width))), True),
            ]
        )
    return requests


@settings(SETTINGS, max_examples=60)
@given(requests=same_header_requests())
def test_requests_with_one_cached_header_never_share_data(requests: list[list[Sent]]) -> None:
    plans = InferPlans()
    calls = []
    headers = set()
    for sent in requests:
        body, length = http_body(sent)
        assert length is not None
        headers.add(body[: int(length)])
        calls.append(prepare_infer(PLAN_MODEL, body, length, plans))
        for item in sent:  # a model may write into its inputs
            calls[-1].payload[item.name][...] = 0
    assert len(headers) == 1
    assert all(call.plan is calls[0].plan for call in calls)
    for call, sent in zip(calls, requests, strict=True):
        for item in sent:
            got = call.payload[item.name]
            assert not got.any(), "another request's decoding wrote into this one's input"
    for sent in requests:  # decoded afresh, after the others were zeroed
        call = prepare_infer(PLAN_MODEL, *http_body(sent), plans)
        for item in sent:
            _assert_received(item.datatype, call.payload[item.name], item.array, item.name)


@settings(SETTINGS, max_examples=60)
@given(requests=same_header_requests(), change=st.integers(-9, 9).filter(bool))
def test_a_cached_header_with_a_body_of_another_length_is_refused(
    requests: list[list[Sent]], change: int
) -> None:
    plans = InferPlans()
    body, length = http_body(requests[0])
    prepare_infer(PLAN_MODEL, body, length, plans)
    assert length is not None
    header_bytes = int(length)
    data = body[header_bytes:]
    wrong = data[: max(0, len(data) + change)] if change < 0 else data + bytes(change)
    with pytest.raises(InvalidInput, match=f"the body has {len(wrong)} bytes after the JSON"):
        prepare_infer(PLAN_MODEL, body[:header_bytes] + wrong, length, plans)


@settings(SETTINGS, max_examples=40)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("send"), st.integers(0, 4), st.booleans()),
            st.tuples(st.just("policy"), st.integers(1, 4), st.booleans()),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_cached_plans_follow_the_models_priority_classes(
    steps: list[tuple[str, int, bool]],
) -> None:
    model = served(list(PLAN_MODEL.inputs), list(PLAN_MODEL.outputs))
    plans = InferPlans()
    generation = 0
    for kind, number, is_binary in steps:
        if kind == "policy":
            generation += 1
            classes = tuple(ClassPolicy(f"c{generation}_{i}") for i in range(number))
            model.batcher.update_policy(classes=classes, default_class=classes[0].name)
            continue
        sent = [
            Sent("a", "FP32", np.ones((1, 2), np.float32), is_binary),
            Sent("b", "INT16", np.ones((1, 1), np.int16), is_binary),
        ]
        inputs = []
        for item in sent:
            infer_input = httpclient.InferInput(item.name, list(item.array.shape), item.datatype)
            inputs.append(infer_input.set_data_from_numpy(item.array, binary_data=is_binary))
        body, size = http_request_of(inputs, "", None, 0, False, False, number, None, None)
        header_length = None if size is None else str(size).encode()
        planned = prepare_infer(model, body, header_length, plans)
        fresh = prepare_infer(model, body, header_length, InferPlans())
        assert planned.options == fresh.options
        classes = model.batcher.policy.classes
        if 1 <= number <= len(classes):
            assert planned.options == {"priority": classes[number - 1].name}
