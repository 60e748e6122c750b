"""KServe v2 REST requests against Triton's own client as the reference.

Requests are built with ``tritonclient.http`` and decoded here. Hand-written bodies cover
what the client never sends: every malformed input, each error naming the input and the
field.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import rapidjson  # what tritonclient.http writes NaN and Infinity with
import tritonclient.http as triton

from carpool.errors import InvalidInput
from carpool.server.kserve.rest_decode import decode_infer_request
from carpool.server.kserve.tensors import (
    DATATYPES,
    InferRequest,
    RequestedOutput,
    serialize_bytes_tensor,
)

from .samples import NUMERIC, sample, triton_input

Client = triton.InferenceServerClient


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
        ("INT64", [True, False], "not true or false"),
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


@pytest.mark.parametrize("binary", [False, True])
def test_a_shape_of_more_dimensions_than_an_array_has_is_invalid_input(binary: bool) -> None:
    """65 dimensions of 1 and 3 elements: NumPy's ValueError was answered as a 500."""
    entry: dict[str, Any] = {"name": "x", "shape": [1] * 64 + [3], "datatype": "FP32"}
    if binary:
        entry["parameters"] = {"binary_data_size": 12}
        body, length = raw_request([entry], bytes(12))
    else:
        body, length = raw_request([{**entry, "data": [1.0, 2.0, 3.0]}])
    assert_invalid(body, length, "input 'x'", "shape has 65 dimensions, more than the 64")


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


def test_json_float_inputs_may_carry_nan_and_infinity_as_tritonclient_sends_them() -> None:
    """Was: tritonclient.http (binary_data=False) serializes with python-rapidjson, which
    writes NaN/Infinity; orjson refuses them, so the request is a 400 'not valid JSON'."""
    tensor = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [math.nan, math.inf]}
    body = rapidjson.dumps({"inputs": [tensor]}).encode()
    assert b"NaN" in body and b"Infinity" in body
    request = decode_infer_request(body, None)
    array = request.inputs[0].array
    assert np.isnan(array[0, 0]) and array[0, 1] == np.inf


# ---------------------------------------------------------------------------------------
# One header, many bodies (planned by carpool.server.kserve.rest, tested there)


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


def test_each_request_id_is_read_from_its_own_header() -> None:
    assert decode_infer_request(*_binary_body("a", [1.0])).request_id == "a"
    assert decode_infer_request(*_binary_body("b", [1.0])).request_id == "b"
    assert decode_infer_request(*_binary_body("a", [1.0])).request_id == "a"


def test_the_binary_size_is_checked_against_each_body() -> None:
    body, header_length = _binary_body(None, [1.0, 2.0])
    decode_infer_request(body, header_length)
    with pytest.raises(InvalidInput, match=r"declare 8 bytes .* but the body has 4 bytes"):
        decode_infer_request(body[:-4], header_length)
