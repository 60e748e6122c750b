"""KServe v2 REST answers against Triton's own client as the reference: answers are
encoded here and parsed by ``tritonclient.http``; JSON answers planned per output shape
are the answers written in full."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import orjson
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.errors import InvalidInput
from carpool.server.kserve.rest_encode import (
    encode_infer_response,
    fill_json_answer,
    json_answer_parts,
)
from carpool.server.kserve.tensors import DATATYPES, OutputTensor

from .samples import NUMERIC, sample

Client = triton.InferenceServerClient


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
