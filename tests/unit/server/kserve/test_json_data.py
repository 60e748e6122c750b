"""JSON tensor numbers: the packed fast path decodes exactly what the general path does.

``_flat_numbers`` packs a flat list with ``struct``; when it declines (None), the general
NumPy path decodes or rejects the list. The property: whenever the fast path answers, its
array equals the general path's in dtype and value, and it never accepts a list the
general path rejects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.errors import InvalidInput
from carpool.server.kserve.json_data import _flat_numbers, _from_json_lists, array_from_json
from carpool.server.kserve.rest_decode import InputSpec

NUMERIC = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
NUMERIC += ["FP16", "FP32", "FP64"]

# What orjson can hand over for a JSON array element, weighted towards numbers.
_elements = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # orjson makes wider ones floats
    st.integers(min_value=-300, max_value=300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e5, max_value=1e5, allow_nan=False),
    st.booleans(),
    st.sampled_from(["1", None, [1.0], {"a": 1}]),
)


def _spec(datatype: str, count: int) -> InputSpec:
    return InputSpec("x", datatype, (count,), count, None, 0)


def _general(spec: InputSpec, data: list[Any]) -> np.ndarray | str:
    try:
        return _from_json_lists(spec, data)
    except InvalidInput as error:
        return str(error)


@settings(max_examples=400, deadline=None)
@given(
    datatype=st.sampled_from(NUMERIC),
    data=st.one_of(
        st.lists(_elements, min_size=1, max_size=12),
        st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), min_size=1, max_size=12),
        st.lists(st.floats(allow_nan=False), min_size=1, max_size=12),
        st.lists(st.booleans(), min_size=1, max_size=4),
    ),
)
def test_fast_path_agrees_with_the_general_path(datatype: str, data: list[Any]) -> None:
    spec = _spec(datatype, len(data))
    fast = _flat_numbers(spec, data)
    if fast is None:
        return  # the general path alone decides
    general = _general(spec, data)
    assert not isinstance(general, str), f"fast path accepted what is rejected: {general}"
    assert fast.dtype == general.dtype
    np.testing.assert_array_equal(fast, general)


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("FP32", [0.5, -2, 3]),
        ("FP32", [1e39, -1e39, 3.4028235e38, 2**70]),  # beyond FP32: inf, as in C
        ("FP64", [1e300, -1e-300, 7]),
        ("INT8", [-128, 0, 127]),
        ("UINT8", [0, 255]),
        ("INT64", [-(2**63), 2**63 - 1]),
        ("UINT64", [0, 2**64 - 1]),
    ],
)
def test_fast_path_takes_flat_lists_of_numbers(datatype: str, data: list[Any]) -> None:
    spec = _spec(datatype, len(data))
    fast = _flat_numbers(spec, data)
    assert fast is not None
    general = _general(spec, data)
    assert not isinstance(general, str)
    assert fast.dtype == general.dtype
    np.testing.assert_array_equal(fast, general)


@pytest.mark.parametrize("datatype", NUMERIC)
def test_fast_path_arrays_are_writable(datatype: str) -> None:
    fast = _flat_numbers(_spec(datatype, 3), [1, 2, 3])
    assert fast is not None
    fast[0] = 7  # a model may work in place on what it is given
    assert fast.tolist() == [7, 2, 3]


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("FP32", [[1.0], [2.0]]),  # nested: the general path flattens it
        ("FP32", ["1.0", 2.0]),
        ("FP32", [True, False]),  # all bools are BOOL data: rejected for FP32
        ("UINT32", [4, True]),  # a bool after a number: refused too (not read as 1)
        ("INT8", [1, 128]),  # out of range: the general path names the range
        ("INT32", [1.5, 2]),
        ("UINT8", [-1, 2]),
        ("UINT64", [-1, 2]),
        ("BOOL", [True, False]),
        ("BYTES", ["a", "b"]),
        ("FP32", [1.0, 2.0, 3.0]),  # count differs from the shape's two elements
    ],
)
def test_fast_path_declines_what_it_does_not_check(datatype: str, data: list[Any]) -> None:
    assert _flat_numbers(_spec(datatype, 2), data) is None


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("FP32", [1, True]),  # was read as [1.0, 1.0]
        ("INT32", [True, 1]),
        ("FP64", [[1.5], [False]]),  # nested: the general path
        ("UINT8", [[0], [True]]),
        ("FP64", [2**70, True]),  # integers past int64: NumPy reads an object array
    ],
)
def test_true_or_false_among_numbers_is_refused_naming_the_input(
    datatype: str, data: list[Any]
) -> None:
    with pytest.raises(InvalidInput, match=f"input 'x': {datatype} data must be numbers, not"):
        array_from_json(_spec(datatype, 2), data)


def test_flat_and_nested_json_data_give_the_same_fp32_values() -> None:
    """Was: the struct fast path (flat lists) rounded int -> float64 -> float32 while the
    general path (nested lists) casts int64 -> float32 directly; for integers above 2**53
    the two differ by one float32 ulp."""
    n = 2**53 + 2**29 + 1
    spec = InputSpec("x", "FP32", (1, 1), 1, None, 0)
    flat, nested = array_from_json(spec, [n]), array_from_json(spec, [[n]])
    assert flat.tolist() == nested.tolist(), f"flat {flat.tolist()} vs nested {nested.tolist()}"
