"""KServe v2 over gRPC, without sockets: ``ModelInferRequest`` messages built with the
generated classes decoded into the typed request, and outputs encoded as raw contents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from carpool import Batcher
from carpool.errors import InvalidInput
from carpool.server.kserve.grpc_codec import decode_infer_request, encode_infer_response
from carpool.server.kserve.tensors import deserialize_bytes_tensor, serialize_bytes_tensor
from carpool.server.proto import grpc_service_pb2 as pb
from carpool.server.repository import ServedModel, TensorSpec

CASES: list[tuple[str, str, np.ndarray]] = [
    ("INT32", "int_contents", np.array([[1, -2, 3], [4, 5, -6]], dtype=np.int32)),
    ("FP32", "fp32_contents", np.array([[0.5, -1.25], [3.0, 1e-3]], dtype=np.float32)),
    ("BOOL", "bool_contents", np.array([[True, False, True]])),
    ("BYTES", "bytes_contents", np.array([[b"a", b""], [b"\x00\xff", b"carpool"]], dtype=object)),
]


def _request(name: str, datatype: str, shape: tuple[int, ...]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def _raw(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes_tensor(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _assert_decoded(request: pb.ModelInferRequest, datatype: str, expected: np.ndarray) -> None:
    (tensor,) = decode_infer_request(request).inputs
    assert tensor.datatype == datatype
    assert tensor.shape == expected.shape
    assert tensor.array.shape == expected.shape
    if datatype == "BYTES":
        assert tensor.array.dtype == object
        assert tensor.array.tolist() == expected.tolist()
    else:
        assert tensor.array.dtype == expected.dtype
        np.testing.assert_array_equal(tensor.array, expected)


@pytest.mark.parametrize(("datatype", "field", "array"), CASES)
def test_decodes_raw_input_contents(datatype: str, field: str, array: np.ndarray) -> None:
    request = _request("X", datatype, array.shape)
    request.raw_input_contents.append(_raw(datatype, array))
    _assert_decoded(request, datatype, array)


@pytest.mark.parametrize(("datatype", "field", "array"), CASES)
def test_decodes_typed_contents(datatype: str, field: str, array: np.ndarray) -> None:
    request = _request("X", datatype, array.shape)
    getattr(request.inputs[0].contents, field).extend(array.ravel().tolist())
    _assert_decoded(request, datatype, array)


def test_raw_contents_follow_input_order() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="A", datatype="INT32", shape=[2])
    request.inputs.add(name="B", datatype="FP32", shape=[1])
    request.raw_input_contents.extend(
        [_raw("INT32", np.array([7, 8], np.int32)), _raw("FP32", np.array([2.5], np.float32))]
    )
    a, b = decode_infer_request(request).inputs
    assert (a.name, a.array.tolist()) == ("A", [7, 8])
    assert (b.name, b.array.tolist()) == ("B", [2.5])


def test_bf16_raw_contents_decode_to_float32() -> None:
    values = np.array([1.0, -2.5, 0.15625], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    request = _request("X", "BF16", (3,))
    request.raw_input_contents.append(bits.tobytes())
    (tensor,) = decode_infer_request(request).inputs
    assert tensor.array.dtype == np.float32
    np.testing.assert_array_equal(tensor.array, values)


def test_request_parameters_keep_their_types() -> None:
    request = _request("X", "INT32", (1,))
    request.inputs[0].contents.int_contents.append(1)
    request.id = "r-7"
    request.parameters["priority"].int64_param = 2
    request.parameters["timeout"].int64_param = 5000
    request.parameters["tag"].string_param = "x"
    decoded = decode_infer_request(request)
    assert decoded.request_id == "r-7"
    assert decoded.parameters == {"priority": 2, "timeout": 5000, "tag": "x"}
    assert decoded.outputs is None


def test_requested_outputs_are_all_binary() -> None:
    request = _request("X", "INT32", (0,))
    request.outputs.add(name="Y")
    (output,) = decode_infer_request(request).outputs or ()
    assert (output.name, output.is_binary) == ("Y", True)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda r: r.raw_input_contents.append(b"\x00" * 3), "has 3 bytes .* need 4"),
        (lambda r: r.inputs[0].contents.int_contents.extend([1, 2]), "has 2"),
        (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "belongs in int_contents"),
        (lambda r: r.raw_input_contents.extend([b"", b""]), "2 entries"),
    ],
)
def test_malformed_data_names_the_problem(build: Any, fragment: str) -> None:
    request = _request("X", "INT32", (1,))
    build(request)
    with pytest.raises(InvalidInput, match=fragment):
        decode_infer_request(request)


def test_rejects_unknown_datatype_and_out_of_range_narrow_ints() -> None:
    with pytest.raises(InvalidInput, match="not one of"):
        decode_infer_request(_request("X", "FP8", (1,)))
    request = _request("X", "INT8", (1,))
    request.inputs[0].contents.int_contents.append(300)
    with pytest.raises(InvalidInput, match=r"\[-128, 127\]"):
        decode_infer_request(request)


def test_fp16_needs_raw_contents() -> None:
    with pytest.raises(InvalidInput, match="raw_input_contents"):
        decode_infer_request(_request("X", "FP16", (1,)))


def test_outputs_go_back_raw_with_classes_as_bytes() -> None:
    outputs = (TensorSpec("y", "FP32", (2,)), TensorSpec("c", "INT32", (3,), labels=("a", "b")))
    model = ServedModel("m", "1", "python", outputs, outputs, Batcher(lambda x: x))
    result = {"y": np.array([[1.5, -2.0]], np.float32), "c": np.array([[3, 9, 1]], np.int32)}
    response = encode_infer_response(model, "r-1", list(outputs), result, {"c": 2})
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "r-1")
    y, c = response.outputs
    assert (y.name, y.datatype, list(y.shape)) == ("y", "FP32", [1, 2])
    assert (c.name, c.datatype, list(c.shape)) == ("c", "BYTES", [1, 2])
    y_raw, c_raw = response.raw_output_contents
    np.testing.assert_array_equal(np.frombuffer(y_raw, "<f4"), [1.5, -2.0])
    assert deserialize_bytes_tensor(c_raw, 2).tolist() == [b"9:1:b", b"3:0:a"]


def test_a_shape_of_more_dimensions_than_an_array_has_is_invalid_input() -> None:
    """65 dimensions of 1 and 3 elements: NumPy's ValueError was answered as INTERNAL."""
    request = _request("X", "FP32", (1,) * 64 + (3,))
    request.raw_input_contents.append(np.arange(3, dtype=np.float32).tobytes())
    with pytest.raises(InvalidInput, match="shape has 65 dimensions, more than the 64"):
        decode_infer_request(request)
    fits = _request("X", "FP32", (1,) * 63 + (3,))
    fits.raw_input_contents.append(np.arange(3, dtype=np.float32).tobytes())
    assert decode_infer_request(fits).inputs[0].array.shape == (1,) * 63 + (3,)
