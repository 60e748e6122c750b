"""The KServe v2 REST tensor codec against Triton's own client as the reference.

Requests are built with ``tritonclient.http`` and decoded here; responses are encoded here
and parsed by ``tritonclient.http``. Hand-written bodies cover what the client never sends:
every malformed input, each error naming the input and the field.
"""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import orjson
import pytest
import tritonclient.http as triton
import tritonclient.utils as triton_utils
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from carpool.errors import InvalidInput
from carpool.server.decode import decode_infer_request
from carpool.server.tensors import (
    DATATYPES,
    InferRequest,
    OutputTensor,
    RequestedOutput,
    datatype_of,
    deserialize_bytes_tensor,
    encode_infer_response,
    fill_json_answer,
    json_answer_parts,
    serialize_bytes_tensor,
)

Client = triton.InferenceServerClient
NUMERIC = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
NUMERIC += ["FP16", "FP32", "FP64"]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> npt.NDArray[Any]:
    """A deterministic array of ``datatype`` that uses the type's range."""
    size = int(np.prod(shape))
    if datatype == "BOOL":
        return (np.arange(size) % 3 == 0).reshape(shape)
    if datatype == "BYTES":
        words = [b"", "héllo".encode(), b"x" * 300, "日本".encode(), b"a", b"\x00z"]
        return np.array([words[i % len(words)] for i in range(size)], dtype=object).reshape(shape)
    dtype = DATATYPES[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = [info.min, info.max, 0, 1, info.max - 1, info.min + 1]
        return np.array([values[i % len(values)] for i in range(size)], dtype=dtype).reshape(shape)
    return (np.linspace(-3.25, 1e3, size) / 7).astype(dtype).reshape(shape)


def triton_input(
    name: str, array: npt.NDArray[Any], datatype: str, *, binary: bool
) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    if datatype == "BF16" and array.dtype == ml_dtypes.bfloat16:
        # tritonclient releases differ: some take ml_dtypes.bfloat16 arrays for BF16,
        # others float32 arrays that they truncate themselves. The bytes are the same.
        try:
            tensor.set_data_from_numpy(array, binary_data=binary)
        except InferenceServerException:
            tensor.set_data_from_numpy(array.astype(np.float32), binary_data=binary)
        return tensor
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def decode_from_client(
    inputs: list[triton.InferInput], **kwargs: Any
) -> tuple[InferRequest, bytes, int | None]:
    body, json_size = Client.generate_request_body(inputs, **kwargs)
    return decode_infer_request(body, json_size), body, json_size


def raw_request(
    inputs: list[dict[str, Any]], binary: bytes = b"", **fields: Any
) -> tuple[bytes, int | None]:
    header = orjson.dumps({"inputs": inputs, **fields})
    if not binary:
        return header, None
    return header + binary, len(header)


def assert_invalid(body: bytes, header_length: int | None, *fragments: str) -> str:
    with pytest.raises(InvalidInput) as caught:
        decode_infer_request(body, header_length)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message
    return message


def as_client_sees(array: npt.NDArray[Any], *, binary: bool) -> npt.NDArray[Any]:
    """tritonclient returns JSON BYTES outputs as str, binary ones as bytes."""
    if binary or array.dtype != object:
        return array
    return np.vectorize(lambda element: element.decode("utf-8"), otypes=[object])(array)


def parse_with_client(
    outputs: list[OutputTensor], binary_names: set[str], **kwargs: Any
) -> triton.InferResult:
    body, header_length = encode_infer_response("model", "1", "req-1", outputs, binary_names)
    return Client.parse_response_body(body, header_length=header_length, **kwargs)


# --- datatypes -------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", ["BOOL", *NUMERIC])
def test_datatype_of_round_trips_through_datatypes(datatype: str) -> None:
    assert datatype_of(np.zeros(2, dtype=DATATYPES[datatype])) == datatype


def test_datatype_of_maps_text_arrays_to_bytes() -> None:
    assert datatype_of(np.array([b"a"], dtype=object)) == "BYTES"
    assert datatype_of(np.array([b"a"])) == "BYTES"
    assert datatype_of(np.array(["a"])) == "BYTES"


def test_datatype_of_recognises_big_endian_and_bfloat16() -> None:
    assert datatype_of(np.zeros(2, dtype=">i4")) == "INT32"
    assert datatype_of(np.zeros(2, dtype=ml_dtypes.bfloat16)) == "BF16"


def test_datatype_of_rejects_unsupported_dtypes() -> None:
    with pytest.raises(InvalidInput, match="complex128 has no KServe datatype"):
        datatype_of(np.zeros(2, dtype=np.complex128))


def test_bf16_decodes_to_float32() -> None:
    assert DATATYPES["BF16"] == np.dtype(np.float32)
    assert DATATYPES["BYTES"] == np.dtype(object)


# --- requests from tritonclient ---------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ["BOOL", *NUMERIC, "BYTES"])
def test_decodes_every_datatype_from_tritonclient(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    request, _, _ = decode_from_client([triton_input("x", array, datatype, binary=binary)])
    (tensor,) = request.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("x", datatype, (2, 3))
    assert tensor.array.dtype == DATATYPES[datatype]
    assert tensor.array.shape == (2, 3)
    np.testing.assert_array_equal(tensor.array, array)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_decodes_bytes_with_empty_and_non_ascii_elements(binary: bool) -> None:
    array = np.array([["", "ünïcødé"], ["€", "plain"]], dtype=object)
    encoded = np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(array)
    request, _, _ = decode_from_client([triton_input("text", encoded, "BYTES", binary=binary)])
    assert request.inputs[0].array.tolist() == [
        [b"", "ünïcødé".encode()],
        [b"\xe2\x82\xac", b"plain"],
    ]


def test_decodes_bf16_binary_to_float32() -> None:
    array = np.array([[1.5, -2.0, 0.0], [3.140625, -1e-3, 65280.0]], dtype=ml_dtypes.bfloat16)
    request, _, _ = decode_from_client([triton_input("x", array, "BF16", binary=True)])
    tensor = request.inputs[0]
    assert tensor.datatype == "BF16"
    assert tensor.array.dtype == np.float32
    np.testing.assert_array_equal(tensor.array, array.astype(np.float32))


def test_decodes_mixed_json_and_binary_inputs_in_order() -> None:
    arrays = {
        "a": (sample("FP32"), "FP32", True),
        "b": (sample("INT64", (4,)), "INT64", False),
        "c": (sample("BYTES", (3,)), "BYTES", True),
        "d": (sample("BOOL", (1, 2)), "BOOL", False),
        "e": (sample("UINT8", (5,)), "UINT8", True),
    }
    inputs = [
        triton_input(name, array, datatype, binary=binary)
        for name, (array, datatype, binary) in arrays.items()
    ]
    request, _, json_size = decode_from_client(inputs)
    assert json_size is not None
    assert [tensor.name for tensor in request.inputs] == list(arrays)
    for tensor in request.inputs:
        np.testing.assert_array_equal(tensor.array, arrays[tensor.name][0])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ["FP32", "BYTES", "BOOL"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_decodes_zero_size_shapes(datatype: str, shape: tuple[int, ...], binary: bool) -> None:
    array = np.empty(shape, dtype=DATATYPES[datatype])
    request, _, _ = decode_from_client([triton_input("x", array, datatype, binary=binary)])
    tensor = request.inputs[0]
    assert tensor.shape == shape
    assert tensor.array.shape == shape
    assert tensor.array.dtype == DATATYPES[datatype]


def test_decoded_binary_arrays_are_writable_and_aligned() -> None:
    inputs = [
        triton_input("odd", sample("UINT8", (3,)), "UINT8", binary=True),
        triton_input("x", sample("FP64"), "FP64", binary=True),
    ]
    request, _, _ = decode_from_client(inputs)
    array = request.inputs[1].array
    assert array.flags.writeable
    assert array.flags.aligned
    array[0, 0] = 1.0


def test_reads_id_parameters_and_requested_outputs() -> None:
    inputs = [triton_input("x", sample("FP32"), "FP32", binary=True)]
    outputs = [triton.InferRequestedOutput("y", binary_data=True)]
    outputs.append(triton.InferRequestedOutput("z", binary_data=False))
    request, _, _ = decode_from_client(
        inputs, outputs=outputs, request_id="abc", priority=2, timeout=1000, parameters={"k": 1}
    )
    assert request.request_id == "abc"
    assert request.outputs == (RequestedOutput("y", True), RequestedOutput("z", False))
    assert request.parameters == {"priority": 2, "timeout": 1000, "k": 1}
    assert request.is_binary_output_default is False


def test_no_outputs_means_all_outputs_with_the_binary_default() -> None:
    inputs = [triton_input("x", sample("FP32"), "FP32", binary=False)]
    request, _, json_size = decode_from_client(inputs)
    assert json_size is None
    assert request.request_id is None
    assert request.outputs is None
    assert request.is_binary_output_default is True


def test_output_without_binary_data_follows_the_request_default() -> None:
    body, _ = raw_request(
        [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}],
        outputs=[{"name": "y"}, {"name": "z", "parameters": {"binary_data": False}}],
        parameters={"binary_data_output": True},
    )
    request = decode_infer_request(body, None)
    assert request.outputs == (RequestedOutput("y", True), RequestedOutput("z", False))


def test_accepts_nested_json_data() -> None:
    body, _ = raw_request(
        [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3.5, 4]]}]
    )
    array = decode_infer_request(body, None).inputs[0].array
    np.testing.assert_array_equal(array, np.array([[1, 2], [3.5, 4]], dtype=np.float32))


# --- request errors ---------------------------------------------------------------------


def test_rejects_malformed_json() -> None:
    assert_invalid(b'{"inputs": [', None, "request body is not valid JSON")


def test_rejects_a_body_that_is_not_an_object() -> None:
    assert_invalid(b"[1, 2]", None, "JSON object")


@pytest.mark.parametrize("inputs", [None, {}, "x"])
def test_rejects_missing_or_wrong_inputs(inputs: object) -> None:
    assert_invalid(orjson.dumps({"inputs": inputs}), None, "'inputs'", "list")


def test_rejects_a_non_string_id() -> None:
    body, _ = raw_request([], id=7)
    assert_invalid(body, None, "'id'", "string")


@pytest.mark.parametrize(
    ("entry", "fragments"),
    [
        ({"shape": [1], "datatype": "FP32", "data": [1]}, ("inputs[0]", "'name'")),
        ({"name": 3, "shape": [1], "datatype": "FP32", "data": [1]}, ("inputs[0]", "'name'")),
        ({"name": "x", "shape": [1], "data": [1]}, ("input 'x'", "datatype None")),
        (
            {"name": "x", "shape": [1], "datatype": "FP8", "data": [1]},
            ("input 'x'", "'FP8'", "BYTES"),
        ),
        ({"name": "x", "datatype": "FP32", "data": [1]}, ("input 'x'", "shape")),
        (
            {"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]},
            ("input 'x'", "shape", ">= 0"),
        ),
        ({"name": "x", "shape": [1.5], "datatype": "FP32", "data": [1]}, ("input 'x'", "shape")),
        ({"name": "x", "shape": [True], "datatype": "FP32", "data": [1]}, ("input 'x'", "shape")),
        ({"name": "x", "shape": "2", "datatype": "FP32", "data": [1]}, ("input 'x'", "shape")),
        (
            {"name": "x", "shape": [1], "datatype": "FP32"},
            ("input 'x'", "'data'", "binary_data_size"),
        ),
        (
            {"name": "x", "shape": [1], "datatype": "FP32", "data": 1},
            ("input 'x'", "'data'", "list"),
        ),
        (
            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1], "parameters": []},
            ("input 'x'", "'parameters'"),
        ),
    ],
)
def test_rejects_malformed_input_entries(entry: dict[str, Any], fragments: tuple[str, ...]) -> None:
    body, _ = raw_request([entry])
    assert_invalid(body, None, *fragments)


def test_rejects_a_non_object_input_entry() -> None:
    body, _ = raw_request([[1]])  # type: ignore[list-item]
    assert_invalid(body, None, "inputs[0]", "JSON object")


def test_rejects_duplicate_input_names() -> None:
    entry = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}
    body, _ = raw_request([entry, entry])
    assert_invalid(body, None, "input 'x'", "more than once")


def test_rejects_json_element_count_mismatch() -> None:
    body, _ = raw_request([{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1] * 5}])
    message = assert_invalid(body, None)
    assert message == "input 'x': shape [2, 3] has 6 elements but data has 5"


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "INT8"])
def test_rejects_json_count_mismatch_for_every_kind(datatype: str) -> None:
    data = {"BYTES": ["a"], "BOOL": [True], "INT8": [1]}[datatype]
    body, _ = raw_request([{"name": "x", "shape": [0], "datatype": datatype, "data": data}])
    assert_invalid(body, None, "input 'x'", "shape [0] has 0 elements but data has 1")


def test_rejects_ragged_json_data() -> None:
    body, _ = raw_request([{"name": "x", "shape": [3], "datatype": "FP32", "data": [[1, 2], [3]]}])
    assert_invalid(body, None, "input 'x'", "'data'", "ragged")


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("BOOL", [1, 0], "true or false"),
        ("FP32", ["1.0", "2"], "numbers"),
        ("FP64", [None, 1], "numbers"),
        ("INT8", [1, 128], "[-128, 127]"),
        ("UINT8", [-1, 2], "[0, 255]"),
        ("INT32", [1.5, 2], "integers"),
        ("INT64", [True, False], "integers"),
        ("UINT64", [1.0, 1], "integers"),
        ("BYTES", ["a", 1], "element 1 must be a string"),
        ("BYTES", [["a"], ["b", "c"]], "element 0 must be a string"),
    ],
)
def test_rejects_json_values_of_the_wrong_type(
    datatype: str, data: list[Any], fragment: str
) -> None:
    body, _ = raw_request([{"name": "x", "shape": [2], "datatype": datatype, "data": data}])
    assert_invalid(body, None, "input 'x'", fragment)


def test_json_integers_spanning_int64_and_uint64_are_numbers_for_float_types() -> None:
    data = [2**64 - 1, -1, 1.5]  # NumPy reads these as objects
    body, _ = raw_request([{"name": "x", "shape": [3], "datatype": "FP64", "data": data}])
    np.testing.assert_array_equal(
        decode_infer_request(body, None).inputs[0].array, [2.0**64, -1.0, 1.5]
    )


def test_json_fp16_overflow_becomes_infinity() -> None:
    body, _ = raw_request([{"name": "x", "shape": [2], "datatype": "FP16", "data": [1e10, -1e10]}])
    np.testing.assert_array_equal(
        decode_infer_request(body, None).inputs[0].array, [np.inf, -np.inf]
    )


def test_rejects_bf16_as_json() -> None:
    body, _ = raw_request([{"name": "x", "shape": [1], "datatype": "BF16", "data": [1.0]}])
    assert_invalid(body, None, "input 'x'", "BF16", "binary")


def test_rejects_both_data_and_binary_size() -> None:
    entry = {"name": "x", "shape": [1], "datatype": "INT8", "data": [1]}
    body, length = raw_request([{**entry, "parameters": {"binary_data_size": 1}}], b"\x01")
    assert_invalid(body, length, "input 'x'", "both 'data' and parameters.binary_data_size")


@pytest.mark.parametrize("size", [-1, "4", 1.0, True])
def test_rejects_a_bad_binary_size(size: object) -> None:
    entry = {
        "name": "x",
        "shape": [1],
        "datatype": "INT8",
        "parameters": {"binary_data_size": size},
    }
    body, length = raw_request([entry], b"\x01")
    assert_invalid(body, length, "input 'x'", "parameters.binary_data_size", ">= 0")


def test_rejects_a_binary_size_that_does_not_fit_the_shape() -> None:
    entry = {
        "name": "x",
        "shape": [2, 3],
        "datatype": "FP32",
        "parameters": {"binary_data_size": 20},
    }
    body, length = raw_request([entry], bytes(20))
    message = assert_invalid(body, length)
    assert (
        message
        == "input 'x': parameters.binary_data_size is 20 bytes but shape [2, 3] of FP32 needs 24"
    )


def test_rejects_a_bf16_binary_size_that_does_not_fit_the_shape() -> None:
    entry = {"name": "x", "shape": [3], "datatype": "BF16", "parameters": {"binary_data_size": 12}}
    body, length = raw_request([entry], bytes(12))
    assert_invalid(body, length, "input 'x'", "is 12 bytes", "needs 6")


def test_rejects_binary_sizes_that_do_not_add_up() -> None:
    inputs = [triton_input("x", sample("INT32", (1,)), "INT32", binary=True)]
    body, json_size = Client.generate_request_body(inputs)
    assert_invalid(body + b"\x00", json_size, "declare 4 bytes", "has 5 bytes")
    assert_invalid(body[:-1], json_size, "declare 4 bytes", "has 3 bytes")


def test_rejects_binary_inputs_without_a_header_length() -> None:
    entry = {"name": "x", "shape": [1], "datatype": "INT8", "parameters": {"binary_data_size": 1}}
    body, _ = raw_request([entry])
    assert_invalid(body, None, "declare 1 bytes", "has 0 bytes after the JSON header")


@pytest.mark.parametrize("header_length", [10_000, -1])
def test_rejects_a_header_length_outside_the_body(header_length: int) -> None:
    inputs = [triton_input("x", sample("INT32", (1,)), "INT32", binary=True)]
    body, _ = Client.generate_request_body(inputs)
    assert_invalid(
        body, header_length, "Inference-Header-Content-Length", str(header_length), str(len(body))
    )


def test_rejects_a_header_length_that_cuts_the_json() -> None:
    inputs = [triton_input("x", sample("INT32", (1,)), "INT32", binary=True)]
    body, json_size = Client.generate_request_body(inputs)
    assert json_size is not None
    assert_invalid(body, json_size - 1, "request body is not valid JSON")


@pytest.mark.parametrize(
    ("binary", "count", "fragment"),
    [
        (
            b"\x01\x00\x00\x00a\x01\x00",
            2,
            "element 1 needs a 4-byte length prefix but only 2 bytes remain",
        ),
        (b"\x05\x00\x00\x00abc", 1, "element 0 declares 5 bytes but only 3 remain"),
        (b"\x01\x00\x00\x00a", 2, "expected 2 elements but found 1"),
        (b"\x01\x00\x00\x00a\x00\x00\x00\x00", 1, "expected 1 elements but 4 bytes remain"),
    ],
)
def test_rejects_malformed_binary_bytes(binary: bytes, count: int, fragment: str) -> None:
    entry = {"name": "s", "shape": [count], "datatype": "BYTES"}
    entry["parameters"] = {"binary_data_size": len(binary)}
    body, length = raw_request([entry], binary)
    assert_invalid(body, length, "input 's': binary BYTES data", fragment)


def test_bytes_binary_size_must_be_consumed_exactly_even_with_a_following_input() -> None:
    good = serialize_bytes_tensor(np.array([b"ab"], dtype=object))
    entries = [
        {
            "name": "s",
            "shape": [1],
            "datatype": "BYTES",
            "parameters": {"binary_data_size": len(good) + 1},
        },
        {"name": "t", "shape": [1], "datatype": "UINT8", "parameters": {"binary_data_size": 1}},
    ]
    body, length = raw_request(entries, good + b"\x07" + b"\x09")
    assert_invalid(body, length, "input 's'", "1 bytes remain")


def test_rejects_shared_memory_inputs() -> None:
    entry = {
        "name": "x",
        "shape": [1],
        "datatype": "INT8",
        "parameters": {"shared_memory_region": "r"},
    }
    body, _ = raw_request([entry])
    assert_invalid(body, None, "input 'x'", "shared memory")


@pytest.mark.parametrize(
    ("outputs", "fragments"),
    [
        ("y", ("'outputs'", "list")),
        ([1], ("outputs[0]", "JSON object")),
        ([{}], ("outputs[0]", "'name'")),
        ([{"name": "y"}, {"name": "y"}], ("output 'y'", "more than once")),
        ([{"name": "y", "parameters": {"binary_data": 1}}], ("output 'y'", "binary_data")),
        ([{"name": "y", "parameters": {"classification": -1}}], ("output 'y'", "classification")),
    ],
)
def test_rejects_malformed_outputs(outputs: object, fragments: tuple[str, ...]) -> None:
    body, _ = raw_request([], outputs=outputs)
    assert_invalid(body, None, *fragments)


@pytest.mark.parametrize("parameters", [[1], {"binary_data_output": "yes"}])
def test_rejects_malformed_request_parameters(parameters: object) -> None:
    body, _ = raw_request([], parameters=parameters)
    assert_invalid(body, None, "request", "parameters")


# --- responses parsed by tritonclient ----------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ["BOOL", *NUMERIC, "BYTES"])
def test_encodes_every_datatype_for_tritonclient(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    result = parse_with_client([OutputTensor("y", array)], {"y"} if binary else set())
    parsed = result.as_numpy("y")
    assert parsed.shape == array.shape
    assert parsed.dtype == DATATYPES[datatype]
    np.testing.assert_array_equal(parsed, as_client_sees(array, binary=binary))
    output = result.get_output("y")
    assert output["datatype"] == datatype
    assert ("parameters" in output) is binary


def test_encodes_bf16_output_as_binary() -> None:
    values = np.array([1.5, -2.0, 3.140625, 1.00390625, np.inf, np.nan], dtype=np.float32)
    result = parse_with_client([OutputTensor("y", values, "BF16")], {"y"})
    parsed = result.as_numpy("y")
    assert parsed.dtype in (ml_dtypes.bfloat16, np.float32)  # as the tritonclient release reads it
    expected = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(parsed.astype(np.float32), expected)


def test_encodes_ml_dtypes_bfloat16_arrays_as_they_are() -> None:
    array = np.array([[0.5, -7.0]], dtype=ml_dtypes.bfloat16)
    parsed = parse_with_client([OutputTensor("y", array)], {"y"}).as_numpy("y")
    np.testing.assert_array_equal(parsed, array)


def test_rejects_bf16_output_as_json() -> None:
    with pytest.raises(InvalidInput, match="output 'y': BF16 can only be returned as binary"):
        encode_infer_response(
            "m", None, None, [OutputTensor("y", np.zeros(2, np.float32), "BF16")], set()
        )


def test_encodes_mixed_outputs_with_the_header_length() -> None:
    outputs = [
        OutputTensor("a", sample("FP32")),
        OutputTensor("b", sample("BYTES", (4,))),
        OutputTensor("c", sample("INT16", (3, 1))),
        OutputTensor("d", sample("BYTES", (2,))),
    ]
    body, header_length = encode_infer_response("m", "2", "id-9", outputs, {"a", "d"})
    assert header_length is not None
    header = orjson.loads(body[:header_length])
    assert (header["model_name"], header["model_version"], header["id"]) == ("m", "2", "id-9")
    assert [output["name"] for output in header["outputs"]] == ["a", "b", "c", "d"]
    result = Client.parse_response_body(body, header_length=header_length)
    for output in outputs:
        expected = as_client_sees(output.array, binary=output.name in {"a", "d"})
        np.testing.assert_array_equal(result.as_numpy(output.name), expected)


def test_pure_json_response_has_no_header_length() -> None:
    body, header_length = encode_infer_response(
        "m", None, None, [OutputTensor("y", sample("FP64"))], set()
    )
    assert header_length is None
    header = orjson.loads(body)
    assert "model_version" not in header
    assert "id" not in header
    assert header["outputs"][0]["data"] == sample("FP64").ravel().tolist()


def test_binary_names_not_among_outputs_are_ignored() -> None:
    _, header_length = encode_infer_response(
        "m", None, None, [OutputTensor("y", sample("INT8"))], {"z"}
    )
    assert header_length is None


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ["FP16", "BYTES", "BOOL"])
def test_encodes_zero_size_outputs(datatype: str, binary: bool) -> None:
    array = np.empty((2, 0), dtype=DATATYPES[datatype])
    parsed = parse_with_client([OutputTensor("y", array)], {"y"} if binary else set()).as_numpy("y")
    assert parsed.shape == (2, 0)


def test_encodes_non_contiguous_and_big_endian_arrays() -> None:
    transposed = np.arange(6, dtype=np.int32).reshape(2, 3).T
    big_endian = np.arange(4, dtype=">f8")
    outputs = [OutputTensor("t", transposed), OutputTensor("b", big_endian)]
    for binary_names in ({"t", "b"}, set()):
        result = parse_with_client(outputs, binary_names)
        np.testing.assert_array_equal(result.as_numpy("t"), transposed)
        np.testing.assert_array_equal(result.as_numpy("b"), big_endian)


def test_explicit_datatype_converts_the_array() -> None:
    result = parse_with_client([OutputTensor("y", np.array([1.5, 2.5]), "FP16")], {"y"})
    parsed = result.as_numpy("y")
    assert parsed.dtype == np.float16
    np.testing.assert_array_equal(parsed, [1.5, 2.5])


def test_str_and_fixed_bytes_arrays_encode_as_bytes() -> None:
    outputs = [OutputTensor("u", np.array(["é", "b"])), OutputTensor("s", np.array([b"ab", b"c"]))]
    for binary_names in ({"u", "s"}, set()):
        result = parse_with_client(outputs, binary_names)
        if binary_names:
            assert result.as_numpy("u").tolist() == ["é".encode(), b"b"]
            assert result.as_numpy("s").tolist() == [b"ab", b"c"]
        else:  # tritonclient hands JSON BYTES back as str
            assert result.as_numpy("u").tolist() == ["é", "b"]
            assert result.as_numpy("s").tolist() == ["ab", "c"]


def test_rejects_non_utf8_bytes_as_json() -> None:
    outputs = [OutputTensor("y", np.array([b"\xff\xfe"], dtype=object))]
    with pytest.raises(InvalidInput, match=r"output 'y'.*UTF-8.*binary_data=true"):
        encode_infer_response("m", None, None, outputs, set())
    parsed = parse_with_client(outputs, {"y"}).as_numpy("y")
    assert parsed.tolist() == [b"\xff\xfe"]


def test_rejects_outputs_without_a_datatype() -> None:
    with pytest.raises(InvalidInput, match="complex64 has no KServe datatype"):
        encode_infer_response(
            "m", None, None, [OutputTensor("y", np.zeros(1, np.complex64))], set()
        )
    with pytest.raises(InvalidInput, match="output 'y': datatype 'FP8'"):
        encode_infer_response("m", None, None, [OutputTensor("y", np.zeros(1), "FP8")], set())


# --- BYTES serialization ----------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.array([[b"", b"a"], ["ü".encode(), b"\x00\xff"]], dtype=object),
        np.array(["text", 7, "日本"], dtype=object),
        np.array([b"ab", b"c"]),
        np.array([[b"x"] * 3] * 2, dtype=object).T,
    ],
)
def test_serialize_bytes_tensor_matches_tritonclient(array: npt.NDArray[Any]) -> None:
    expected = triton_utils.serialize_byte_tensor(array).item()
    assert serialize_bytes_tensor(array) == expected
    parsed = deserialize_bytes_tensor(expected, array.size)
    assert parsed.tolist() == triton_utils.deserialize_bytes_tensor(expected).tolist()


def test_serialize_empty_bytes_tensor() -> None:
    assert serialize_bytes_tensor(np.empty((0, 3), dtype=object)) == b""
    parsed = deserialize_bytes_tensor(b"", 0)
    assert parsed.shape == (0,)
    assert parsed.dtype == object


def test_deserialize_bytes_tensor_keeps_bytes_elements() -> None:
    parsed = deserialize_bytes_tensor(b"\x00\x00\x00\x00\x02\x00\x00\x00ab", 2)
    assert parsed.tolist() == [b"", b"ab"]
    assert parsed.dtype == object


def test_deserialize_bytes_tensor_rejects_count_mismatch() -> None:
    with pytest.raises(InvalidInput, match="BYTES tensor: expected 3 elements but found 2"):
        deserialize_bytes_tensor(b"\x00\x00\x00\x00" * 2, 3)


@pytest.mark.parametrize(
    ("datatype", "text", "fragment"),
    [
        ("UINT64", b"[18446744073709551616, 1]", "integers in [0, 18446744073709551615]"),
        ("UINT64", b"[-1, 18446744073709551615]", "integers in [0, 18446744073709551615]"),
        ("INT64", b"[9223372036854775808, 1]", "integers in [-9223372036854775808"),
    ],
)
def test_rejects_out_of_range_64_bit_json_integers(
    datatype: str, text: bytes, fragment: str
) -> None:
    body = b'{"inputs": [{"name": "x", "shape": [2], "datatype": "%s", "data": %s}]}' % (
        datatype.encode(),
        text,
    )
    assert_invalid(body, None, "input 'x'", fragment)


def test_accepts_the_full_uint64_range_in_json() -> None:
    body = b'{"inputs": [{"name": "x", "shape": [3], "datatype": "UINT64", '
    body += b'"data": [0, 18446744073709551615, 1]}]}'
    array = decode_infer_request(body, None).inputs[0].array
    assert array.dtype == np.uint64
    assert array.tolist() == [0, 2**64 - 1, 1]


# ---------------------------------------------------------------------------------------
# The parsed-header cache of binary requests


def _binary_body(request_id: str | None, values: list[float]) -> tuple[bytes, int]:
    data = np.asarray(values, dtype=np.float32).tobytes()
    document: dict[str, Any] = {
        "inputs": [
            {
                "name": "x",
                "shape": [1, len(values)],
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(data)},
            }
        ],
        "parameters": {"priority": 1},
    }
    if request_id is not None:
        document["id"] = request_id
    header = orjson.dumps(document)
    return header + data, len(header)


def test_a_repeated_binary_header_decodes_each_body_afresh() -> None:
    first = decode_infer_request(*_binary_body(None, [1.0, 2.0]))
    second = decode_infer_request(*_binary_body(None, [3.0, 4.0]))
    np.testing.assert_array_equal(first.inputs[0].array, [[1.0, 2.0]])
    np.testing.assert_array_equal(second.inputs[0].array, [[3.0, 4.0]])
    assert first.inputs[0].array is not second.inputs[0].array
    second.parameters["priority"] = 3  # each request owns its parameters
    assert decode_infer_request(*_binary_body(None, [5.0, 6.0])).parameters == {"priority": 1}


def test_the_header_cache_keeps_request_ids_apart() -> None:
    assert decode_infer_request(*_binary_body("a", [1.0])).request_id == "a"
    assert decode_infer_request(*_binary_body("b", [1.0])).request_id == "b"
    assert decode_infer_request(*_binary_body("a", [1.0])).request_id == "a"


def test_a_cached_header_still_checks_the_binary_size() -> None:
    body, header_length = _binary_body(None, [1.0, 2.0])
    decode_infer_request(body, header_length)
    with pytest.raises(InvalidInput, match=r"declare 8 bytes .* but the body has 4 bytes"):
        decode_infer_request(body[:-4], header_length)


def test_the_header_cache_is_bounded() -> None:
    from carpool.server import decode

    for i in range(decode._HeaderCache.SIZE + 50):
        decode_infer_request(*_binary_body(f"id-{i}", [1.0]))
    assert len(decode._HEADERS._entries) <= decode._HeaderCache.SIZE


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=12
    ),
    name=st.sampled_from(["mlp", "null", "nullish", "m-1"]),
    request_id=st.sampled_from([None, "", "null", "[null", ",null]", "x"]),
    datatype=st.sampled_from(["FP16", "FP32", "FP64"]),
)
def test_json_answers_carry_non_finite_floats_as_triton_writes_them(
    values: list[float], name: str, request_id: str | None, datatype: str
) -> None:
    """Non-finite outputs are found by looking for orjson's null in the answer, then at the
    arrays: whatever the names and ids around them hold, the answer reads back (as
    tritonclient reads it, NaN and Infinity allowed) to the values sent."""
    dtype = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[datatype]
    with np.errstate(over="ignore"):
        array = np.array(values, dtype=np.float64).astype(dtype).reshape(1, -1)
    body, length = encode_infer_response(
        name, "1", request_id, [OutputTensor("Y", array, datatype)], set()
    )
    assert length is None
    document = json.loads(body)
    assert document["model_name"] == name
    got = np.array(document["outputs"][0]["data"], dtype=np.float64).astype(dtype)
    np.testing.assert_array_equal(got, array.reshape(-1))  # shortest repr of each width


JSON_OUTPUT_TYPES = ["BOOL", *NUMERIC]


@st.composite
def json_outputs(draw: st.DrawFn) -> list[OutputTensor]:
    outputs = []
    names = draw(st.lists(st.text(max_size=8), min_size=1, max_size=3, unique=True))
    for name in names:
        datatype = draw(st.sampled_from(JSON_OUTPUT_TYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
        count = int(np.prod(shape))
        if datatype == "BOOL":
            values: list[Any] = draw(st.lists(st.booleans(), min_size=count, max_size=count))
            array = np.array(values, dtype=bool).reshape(shape)
        elif datatype.startswith("FP"):
            floats = st.floats(width=16 if datatype == "FP16" else 32)  # NaN, infinities
            values = draw(st.lists(floats, min_size=count, max_size=count))
            array = np.array(values, dtype=DATATYPES[datatype]).reshape(shape)
        else:
            info = np.iinfo(DATATYPES[datatype])
            ints = st.integers(int(info.min), int(info.max))
            values = draw(st.lists(ints, min_size=count, max_size=count))
            array = np.array(values, dtype=DATATYPES[datatype]).reshape(shape)
        outputs.append(OutputTensor(name, array, datatype))
    return outputs


@settings(max_examples=300, deadline=None)
@given(
    outputs=json_outputs(),
    name=st.sampled_from(["mlp", 'da"ta', '"data":[]', "null"]),
    request_id=st.one_of(st.none(), st.text(max_size=12), st.just('"data":[]')),
    version=st.sampled_from([None, "1"]),
)
def test_json_answers_cut_where_the_data_goes_are_the_answers_written_in_full(
    outputs: list[OutputTensor], name: str, request_id: str | None, version: str | None
) -> None:
    """A planned JSON answer fills the parts of an answer written once: byte for byte
    what encode_infer_response writes, whatever the names and ids hold; NaN and the
    infinities are left to encode_infer_response."""
    described = [(o.name, o.datatype, o.array.shape) for o in outputs]
    parts = json_answer_parts(name, version, request_id, described)
    assert parts is not None
    filled = fill_json_answer(parts, [o.datatype for o in outputs], [o.array for o in outputs])
    full, length = encode_infer_response(name, version, request_id, outputs, set())
    assert length is None
    is_finite = all(np.isfinite(o.array).all() for o in outputs if o.array.dtype.kind == "f")
    if is_finite:
        assert filled == full
    else:
        assert filled is None


def test_no_json_answer_parts_for_bytes_or_bf16_outputs() -> None:
    for datatype in ("BYTES", "BF16"):
        assert json_answer_parts("m", "1", None, [("y", datatype, (1,))]) is None
