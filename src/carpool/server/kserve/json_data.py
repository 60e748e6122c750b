"""A JSON input's ``data`` as its array: what REST requests without the binary extension
carry, and ``tritonclient.http`` sends with ``binary_data=False``.

``data`` is the tensor's values in row-major order, flat or nested as the shape
(``[1, 2, 3, 4]`` or ``[[1, 2], [3, 4]]`` for shape [2, 2]); BYTES values are strings,
sent on as their UTF-8 bytes. A flat list of numbers is packed by ``struct``
(:func:`_flat_numbers`); anything else takes NumPy's general path, which decodes or
refuses it with its message; both give the same array for what both take.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from carpool.errors import InvalidInput
from carpool.server.kserve.tensors import DATATYPES

__all__ = ["JsonInput", "array_from_json"]


class JsonInput(Protocol):
    """What decoding an input's JSON data needs of its checked header entry."""

    @property
    def name(self) -> str: ...

    @property
    def datatype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def num_elements(self) -> int: ...


def array_from_json(spec: JsonInput, data: list[Any]) -> npt.NDArray[Any]:
    """The JSON ``data`` of input ``spec`` as its flat array (BYTES: objects, each the
    UTF-8 ``bytes`` of a string).

    Raises:
        InvalidInput: naming the input: data that is ragged, of another count than the
            shape's, or of values the datatype cannot hold.
    """
    flat = _flat_numbers(spec, data)
    return flat if flat is not None else _from_json_lists(spec, data)


def _from_json_lists(spec: JsonInput, data: list[Any]) -> npt.NDArray[Any]:
    """Any JSON ``data`` (nested lists of any values) as the flat array of ``spec``."""
    where = f"input {spec.name!r}"
    if spec.datatype == "BYTES":
        flat = _bytes_from_json(where, data)
    else:
        try:
            parsed = np.array(data)
        except (ValueError, TypeError):
            raise InvalidInput(f"{where}: 'data' is a ragged nested list") from None
        flat = parsed.reshape(-1)
        if flat.size == spec.num_elements and flat.size > 0:
            flat = _cast_json_numbers(where, spec.datatype, flat, data)
    if flat.size != spec.num_elements:
        raise InvalidInput(
            f"{where}: shape {list(spec.shape)} has {spec.num_elements} elements but "
            f"data has {flat.size}"
        )
    if flat.size == 0:
        return np.empty(0, dtype=DATATYPES[spec.datatype])
    return flat


def _flat_numbers(spec: JsonInput, data: list[Any]) -> npt.NDArray[Any] | None:
    """A flat list of numbers as the array of ``spec``, packed by ``struct`` (faster than
    ``np.array`` on a list of Python floats: docs/benchmarks.md); None when the list is not
    such a list (nested, strings, bools, a value out of range), which the general path then
    decodes or rejects with its message.

    Accepts exactly what the general path accepts: a list starting with a bool goes
    there, since NumPy reads an all-bool list as BOOL, which a number type rejects.
    """
    dtype = DATATYPES[spec.datatype]
    kind = dtype.kind
    count = len(data)
    if (
        kind not in "iuf"
        or spec.datatype == "BF16"
        or count != spec.num_elements
        or not count
        or type(data[0]) is bool
    ):
        return None
    flat = _packed(dtype, count, data)
    if flat is not None and _may_hold_bools(flat) and bool in map(type, data):
        return None  # true/false among numbers (packed as 1/0): the general path refuses it
    return flat


def _may_hold_bools(flat: npt.NDArray[Any]) -> bool:
    """Whether numbers read from JSON could have been true or false (they read as 1 and
    0): only then is each element's type looked at, which costs more than the read."""
    return bool(np.any((flat == 0) | (flat == 1)))


def _packed(dtype: np.dtype[Any], count: int, data: list[Any]) -> npt.NDArray[Any] | None:
    """``data``'s ``count`` numbers as ``dtype`` through ``struct``; None where it cannot."""
    kind = dtype.kind
    if kind == "f" and dtype.itemsize >= 4:  # FP32, FP64: packed in their own width
        code = "f" if dtype.itemsize == 4 else "d"
        packer = _packer(code, count)
        buffer = bytearray(packer.size)  # writable, kept by the array
        try:
            packer.pack_into(buffer, 0, *data)
        except OverflowError:  # beyond FP32: through float64, where it becomes inf
            pass
        except (struct.error, TypeError):
            return None
        else:
            return np.frombuffer(buffer, dtype=_WIDE[code])
    code = "d" if kind == "f" else "Q" if dtype.itemsize == 8 and kind == "u" else "q"
    try:
        packed = _packer(code, count).pack(*data)
    except (struct.error, OverflowError, TypeError):
        return None
    wide = np.frombuffer(packed, dtype=_WIDE[code])
    if kind == "f":
        with np.errstate(over="ignore"):  # too large for FP16/FP32 becomes inf, as in C
            return wide.astype(dtype)
    if dtype.itemsize < 8:
        limits = np.iinfo(dtype)
        if wide.min() < limits.min or wide.max() > limits.max:
            return None
    return wide.astype(dtype)


_WIDE: dict[str, np.dtype[Any]] = {
    "f": np.dtype("=f4"),
    "d": np.dtype("=f8"),
    "q": np.dtype("=i8"),
    "Q": np.dtype("=u8"),
}


@functools.lru_cache(maxsize=64)
def _packer(code: str, count: int) -> struct.Struct:
    return struct.Struct(f"={count}{code}")


def _bytes_from_json(where: str, data: list[Any]) -> npt.NDArray[Any]:
    try:
        nested = np.array(data, dtype=object)
    except ValueError:
        raise InvalidInput(f"{where}: 'data' is a ragged nested list") from None
    flat = nested.reshape(-1)
    for index, element in enumerate(flat.tolist()):
        if not isinstance(element, str):
            raise InvalidInput(
                f"{where}: BYTES data element {index} must be a string, got {element!r}"
            )
        flat[index] = element.encode("utf-8")
    return flat


def _flat_values(data: list[Any]) -> list[Any]:
    """The elements of a nested JSON list, flattened (a ragged one is refused before)."""
    values: list[Any] = np.array(data, dtype=object).reshape(-1).tolist()
    return values


def _cast_json_numbers(
    where: str, datatype: str, parsed: npt.NDArray[Any], data: list[Any]
) -> npt.NDArray[Any]:
    dtype = DATATYPES[datatype]
    kind = parsed.dtype.kind
    if dtype.kind == "b":
        if kind != "b":
            raise InvalidInput(f"{where}: BOOL data must be true or false")
        return parsed
    may_hold_bools = kind == "O" or (kind in "iuf" and _may_hold_bools(parsed))
    if kind == "b" or (may_hold_bools and bool in map(type, _flat_values(data))):
        # NumPy reads [1, true] as [1, 1]: a JSON true or false is not a number.
        raise InvalidInput(f"{where}: {datatype} data must be numbers, not true or false")
    if dtype.kind == "f":
        if kind == "O":  # UINT64-sized integers next to negative ones: still numbers
            parsed = _wide_integers_as_floats(where, datatype, data)
        elif kind not in "iuf":
            raise InvalidInput(f"{where}: {datatype} data must be numbers")
        if kind in "iu":  # through float64, as the flat path and Triton (a double) do
            parsed = parsed.astype(np.float64)
        with np.errstate(over="ignore"):  # too large for FP16/FP32 becomes inf, as in C
            return parsed.astype(dtype)
    limits = np.iinfo(dtype)
    if kind not in "iu":
        # NumPy infers float64 or object when ints span int64 and uint64 (UINT64 values
        # above 2**63 - 1 next to small ones); check those element by element.
        values = _flat_values(data)
        if not all(type(value) is int for value in values):
            raise InvalidInput(
                f"{where}: {datatype} data must be integers in [{limits.min}, {limits.max}]"
            )
        parsed = np.array(values, dtype=object)
    if parsed.min() < limits.min or parsed.max() > limits.max:
        raise InvalidInput(
            f"{where}: {datatype} data must be integers in [{limits.min}, {limits.max}]"
        )
    return parsed.astype(dtype)


def _wide_integers_as_floats(where: str, datatype: str, data: list[Any]) -> npt.NDArray[Any]:
    values = _flat_values(data)
    if not all(type(value) in (int, float) for value in values):  # true/false are not
        raise InvalidInput(f"{where}: {datatype} data must be numbers")
    return np.array(values, dtype=np.float64)
