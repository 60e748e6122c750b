"""KServe v2 tensors between the wire and the server, the same for REST and gRPC.

Here are the datatypes, the typed values a request and an answer are made of, and each
tensor's raw bytes both ways: one reader (:func:`array_from_raw`) for REST's binary
extension and gRPC's ``raw_input_contents``, one writer (:func:`tensor_bytes`) for REST's
binary answers and gRPC's ``raw_output_contents``. Raw bytes are little-endian row-major
values; a BYTES tensor is, per element in row-major order, a 4-byte little-endian length
then the bytes; BF16 is 2 bytes per value, decoded to float32::

    FP32 [2]    [ v0: 4 bytes ][ v1: 4 bytes ]
    BYTES [2]   [ len0: 4 bytes ][ len0 bytes ][ len1: 4 bytes ][ len1 bytes ]

Nothing here knows HTTP or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from carpool.errors import InvalidInput

__all__ = [
    "DATATYPES",
    "DATATYPE_NAMES",
    "UNSUPPORTED_OUTPUT_PARAMETERS",
    "WIRE_DTYPES",
    "InferRequest",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "array_from_raw",
    "check_empty_shape",
    "datatype_of",
    "deserialize_bytes_tensor",
    "numbers_from_raw",
    "serialize_bytes_tensor",
    "tensor_bytes",
    "unsupported_output_parameter",
]

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
    "BF16": np.dtype(np.float32),  # decoded values; on the wire 2 bytes each
}

DATATYPE_NAMES = ", ".join(DATATYPES)
# Wire dtypes of the fixed-size types: little-endian whatever the host.
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    name: dtype.newbyteorder("<")
    for name, dtype in DATATYPES.items()
    if name not in ("BYTES", "BF16")
}
WIRE_DTYPES["BF16"] = np.dtype("<u2")
_NAME_OF: dict[np.dtype[Any], str] = {
    dtype: name for name, dtype in DATATYPES.items() if name not in ("BYTES", "BF16")
}
_LENGTH_PREFIX_BYTES = 4
_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)  # NumPy refuses any array past it, even empty


def datatype_of(array: npt.NDArray[Any]) -> str:
    """The KServe datatype of ``array``: object/bytes/str arrays are BYTES.

    Raises:
        InvalidInput: the dtype has no KServe datatype (complex, datetime, ...).
    """
    dtype = array.dtype
    if dtype.kind in "OSU":
        return "BYTES"
    if dtype.name == "bfloat16":  # ml_dtypes.bfloat16, without importing ml_dtypes
        return "BF16"
    name = _NAME_OF.get(dtype.newbyteorder("="))
    if name is None:
        raise InvalidInput(
            f"array dtype {dtype} has no KServe datatype; expected one of {DATATYPE_NAMES}"
        )
    return name


# Requested-output parameters of Triton extensions carpool does not implement (its
# classification extension is served: carpool.server.classification).
UNSUPPORTED_OUTPUT_PARAMETERS = ("shared_memory_region",)


def unsupported_output_parameter(where: str, name: str, value: object) -> InvalidInput:
    """The error for a requested output asking for ``name``, one of
    UNSUPPORTED_OUTPUT_PARAMETERS, named as Triton's extension names it."""
    return InvalidInput(
        f"{where}: parameters.{name} is not supported: carpool has no shared memory "
        "extension; the output comes back in the answer"
    )


MAX_DIMS = 64  # NumPy's limit on an array's dimensions


def check_num_dims(where: str, shape: tuple[int, ...]) -> None:
    """Refuse a shape of more dimensions than an array may have (NumPy's ValueError was
    answered as the server's fault, 500 / INTERNAL). ``where`` starts the message.

    Raises:
        InvalidInput: naming the count.
    """
    if len(shape) > MAX_DIMS:
        raise InvalidInput(
            f"{where}: shape has {len(shape)} dimensions, more than the {MAX_DIMS} a tensor "
            "may have"
        )


def check_empty_shape(where: str, datatype: str, shape: tuple[int, ...]) -> None:
    """Refuse a shape without elements whose other dimensions no array can have.

    A shape with elements is bounded by the data that must fill it; one with a zero
    dimension is not, and NumPy refuses (ValueError) an array, even an empty one, whose
    nonzero dimensions times its item size pass the largest ``intp``. ``where`` starts
    the message.

    Raises:
        InvalidInput: naming the shape.
    """
    size_bytes = DATATYPES[datatype].itemsize
    for dim in shape:
        if dim:
            size_bytes *= dim
    if size_bytes > _MAX_ARRAY_BYTES:
        raise InvalidInput(
            f"{where}: shape {list(shape)} is too large: its nonzero dimensions times "
            f"{DATATYPES[datatype].itemsize} bytes per {datatype} pass {_MAX_ARRAY_BYTES} "
            "bytes, more than any array can hold"
        )


# ---------------------------------------------------------------------------------------
# Values between the wire and the server


@dataclass(frozen=True, slots=True)
class InputTensor:
    """One decoded input; ``array`` is already reshaped to ``shape`` and writable."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the client asked for, whether it wants it as binary data, and how many
    top classes it wants instead of the tensor (``parameters.classification``; 0: none)."""

    name: str
    is_binary: bool
    class_count: int = 0


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A decoded inference request."""

    request_id: str | None
    inputs: tuple[InputTensor, ...]
    outputs: tuple[RequestedOutput, ...] | None  # None: the client asked for all outputs
    parameters: dict[str, Any]
    is_binary_output_default: bool  # parameters.binary_data_output


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One model output to encode; ``datatype`` None means ``datatype_of(array)``."""

    name: str
    array: npt.NDArray[Any]
    datatype: str | None = None


# ---------------------------------------------------------------------------------------
# BYTES elements


def serialize_bytes_tensor(array: npt.NDArray[Any]) -> bytes:
    """Row-major BYTES elements, each a 4-byte little-endian length then its bytes.

    bytes elements are sent as they are; anything else as ``str(element)`` in UTF-8, as
    Triton's client does.
    """
    parts: list[bytes] = []
    for element in array.ravel(order="C").tolist():
        data = element if isinstance(element, bytes) else str(element).encode("utf-8")
        parts.append(len(data).to_bytes(_LENGTH_PREFIX_BYTES, "little"))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(
    buffer: bytes | memoryview, count: int, *, what: str = "BYTES tensor"
) -> npt.NDArray[Any]:
    """Parse ``count`` length-prefixed elements that fill ``buffer`` exactly.

    Returns a 1-D object array of bytes. ``what`` starts the error message.

    Raises:
        InvalidInput: a length prefix or element runs past the end, or the buffer holds
            more or fewer than ``count`` elements.
    """
    view = memoryview(buffer)
    size = len(view)
    elements: list[bytes] = []
    offset = 0
    while offset < size:
        if len(elements) == count:
            raise InvalidInput(
                f"{what}: expected {count} elements but {size - offset} bytes remain after them"
            )
        if offset + _LENGTH_PREFIX_BYTES > size:
            raise InvalidInput(
                f"{what}: element {len(elements)} needs a 4-byte length prefix but only "
                f"{size - offset} bytes remain"
            )
        length = int.from_bytes(view[offset : offset + _LENGTH_PREFIX_BYTES], "little")
        offset += _LENGTH_PREFIX_BYTES
        if offset + length > size:
            raise InvalidInput(
                f"{what}: element {len(elements)} declares {length} bytes but only "
                f"{size - offset} remain"
            )
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    if len(elements) != count:
        raise InvalidInput(f"{what}: expected {count} elements but found {len(elements)}")
    array = np.empty(count, dtype=object)
    array[:] = elements
    return array


# ---------------------------------------------------------------------------------------
# Raw bytes, both ways


def array_from_raw(
    raw: bytes | memoryview, datatype: str, num_elements: int, *, name: str, source: str
) -> npt.NDArray[Any]:
    """``num_elements`` values of ``datatype`` read from their raw bytes, flat, as an owned
    array in the datatype's NumPy dtype (BF16: float32; BYTES: objects, each ``bytes``).
    The caller has checked that a fixed-size datatype's ``raw`` holds exactly that many
    values (each wire says so in its own words). A BYTES error names input ``name`` and
    its data as the wire calls it (``source``: "binary", "raw").

    Raises:
        InvalidInput: BYTES elements that do not fill ``raw`` exactly.
    """
    if datatype == "BYTES":
        what = f"input {name!r}: {source} BYTES data"
        return deserialize_bytes_tensor(raw, num_elements, what=what)
    if datatype == "BF16":
        bits = np.frombuffer(raw, dtype=WIRE_DTYPES["BF16"], count=num_elements)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return numbers_from_raw(raw, WIRE_DTYPES[datatype], DATATYPES[datatype], num_elements)


def numbers_from_raw(
    raw: bytes | memoryview, wire: np.dtype[Any], dtype: np.dtype[Any], count: int, offset: int = 0
) -> npt.NDArray[Any]:
    """``count`` fixed-size numbers of ``wire`` dtype at ``offset`` of ``raw``, copied into
    ``dtype``: a request's bytes are immutable and their offsets unaligned, and models
    want owned, aligned, native, writable arrays."""
    return np.frombuffer(raw, wire, count, offset).astype(dtype)


def tensor_bytes(datatype: str, array: npt.NDArray[Any]) -> bytes:
    """``array`` as KServe binary data of ``datatype``."""
    if datatype == "BYTES":
        return serialize_bytes_tensor(array)
    if datatype == "BF16":
        return _bf16_bits(array).tobytes()
    return np.ascontiguousarray(array, dtype=WIRE_DTYPES[datatype]).tobytes()


def _bf16_bits(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if array.dtype.name == "bfloat16":
        return np.ascontiguousarray(array).view(np.uint16).astype("<u2", copy=False)
    # Round float32 to nearest even bfloat16; NaN stays a (quiet) NaN.
    values = np.ascontiguousarray(array, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    rounded[np.isnan(values)] = 0x7FC0
    return rounded
