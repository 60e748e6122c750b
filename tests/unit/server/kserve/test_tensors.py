"""KServe tensors between the wire and the server: datatypes, BYTES elements against
Triton's own client, and raw bytes read and written alike for both wires."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.utils as triton_utils
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.errors import InvalidInput
from carpool.server.kserve.tensors import (
    DATATYPES,
    WIRE_DTYPES,
    array_from_raw,
    datatype_of,
    deserialize_bytes_tensor,
    serialize_bytes_tensor,
    tensor_bytes,
)

from .samples import NUMERIC, sample

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


# --- raw bytes: one reader and one writer for both wires --------------------------------


@settings(max_examples=200, deadline=None)
@given(
    datatype=st.sampled_from(["BOOL", *NUMERIC, "BYTES", "BF16"]),
    shape=st.sampled_from([(0,), (3,), (2, 3)]),
)
def test_raw_bytes_read_back_what_tensor_bytes_wrote(datatype: str, shape: tuple[int, ...]) -> None:
    """What REST's binary answers and gRPC's raw_output_contents carry reads back, through
    the reader of REST's binary data and gRPC's raw_input_contents, to the array written
    (BF16 rounded to bfloat16, as ml_dtypes rounds it)."""
    array = sample("FP32" if datatype == "BF16" else datatype, shape)
    raw = tensor_bytes(datatype, array)
    got = array_from_raw(raw, datatype, array.size, name="x", source="raw").reshape(shape)
    assert got.dtype == DATATYPES[datatype]
    if datatype == "BF16":
        array = array.astype(ml_dtypes.bfloat16).astype(np.float32)
    if datatype == "BYTES":
        assert got.tolist() == array.tolist()
    else:
        np.testing.assert_array_equal(got, array)


def test_raw_arrays_are_owned_native_and_writable_at_any_offset() -> None:
    values = np.arange(4, dtype="<f8")
    body = b"\x01" + values.tobytes()  # one byte before: the values are unaligned
    got = array_from_raw(memoryview(body)[1:], "FP64", 4, name="x", source="binary")
    assert got.flags.owndata and got.flags.aligned and got.flags.writeable
    assert got.dtype == np.dtype(np.float64) and got.dtype.isnative
    np.testing.assert_array_equal(got, values)
    assert WIRE_DTYPES["FP64"] == np.dtype("<f8")


@pytest.mark.parametrize("source", ["binary", "raw"])
def test_a_raw_bytes_error_names_the_input_and_the_wires_word_for_its_data(source: str) -> None:
    with pytest.raises(InvalidInput, match=f"^input 's': {source} BYTES data: expected 2"):
        array_from_raw(b"\x01\x00\x00\x00a", "BYTES", 2, name="s", source=source)
