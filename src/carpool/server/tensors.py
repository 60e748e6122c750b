"""KServe v2 (Open Inference Protocol) tensors over REST, with Triton's binary extension.

A request or response body is a JSON header, optionally followed by raw tensor bytes::

    body = [ JSON header (header_length bytes) ][ tensor 0 bytes ][ tensor 1 bytes ] ...
             ^ "inputs"/"outputs" in order; a binary tensor says parameters.binary_data_size

The header length travels in the ``Inference-Header-Content-Length`` HTTP header; without
it the whole body is JSON. Fixed-size tensors are raw little-endian row-major values; a
BYTES tensor is, per element in row-major order, a 4-byte little-endian length then the
bytes. BF16 travels only in binary (2 bytes per value) and is decoded to float32.

Decoding requests is in :mod:`carpool.server.decode`; here are the datatypes, the values
between the wire and the server, BYTES elements and the encoding of responses. Nothing
here knows HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

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
    "check_empty_shape",
    "datatype_of",
    "deserialize_bytes_tensor",
    "encode_infer_response",
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
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
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
# Responses


def encode_infer_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: list[OutputTensor],
    binary_names: set[str],
) -> tuple[bytes, int | None]:
    """Encode a REST inference response.

    Outputs named in ``binary_names`` go as binary data after the JSON header, in output
    order; the others as flat JSON ``data``.

    Returns:
        (body, header_length): header_length is None when no output is binary (the body is
        pure JSON), else the JSON header's length for Inference-Header-Content-Length.

    Raises:
        InvalidInput: an output's dtype has no KServe datatype, a JSON BYTES output is not
            valid UTF-8, or a BF16 output was asked for as JSON.
    """
    header = _response_header(model_name, model_version, request_id)
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for output in outputs:
        datatype = output.datatype or datatype_of(output.array)
        if datatype not in DATATYPES:
            raise InvalidInput(
                f"output {output.name!r}: datatype {datatype!r} is not one of {DATATYPE_NAMES}"
            )
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": datatype,
            "shape": list(output.array.shape),
        }
        if output.name in binary_names:
            chunk = tensor_bytes(datatype, output.array)
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = _to_json_data(output.name, datatype, output.array)
        entries.append(entry)
    header["outputs"] = entries
    json_header = orjson.dumps(header, option=_JSON_OPTIONS)
    # orjson writes NaN and infinities as null, which an answer holds nowhere else but in
    # strings: only then are the arrays looked at (cheaper than np.isfinite on each).
    if b"null" in json_header and not _all_finite(entries):
        json_header = _dumps_non_finite(header)
    if not chunks:
        return json_header, None
    return b"".join([json_header, *chunks]), len(json_header)


def _response_header(
    model_name: str, model_version: str | None, request_id: str | None
) -> dict[str, Any]:
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if request_id:  # an empty id is left out, as Triton leaves it out
        header["id"] = request_id
    return header


_DATA_HOLE = b'"data":[]'


def json_answer_parts(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: list[tuple[str, str, tuple[int, ...]]],
) -> tuple[bytes, ...] | None:
    """The JSON answer :func:`encode_infer_response` writes for outputs of these
    ``(name, datatype, shape)``, all as JSON ``data``, cut where each output's data goes
    (:func:`fill_json_answer`). None for BYTES or BF16 outputs."""
    if any(datatype in ("BYTES", "BF16") for _, datatype, _ in outputs):
        return None
    header = _response_header(model_name, model_version, request_id)
    header["outputs"] = [
        {"name": name, "datatype": datatype, "shape": list(shape), "data": []}
        for name, datatype, shape in outputs
    ]
    # A quote inside a JSON string is escaped: '"data":[]' is only ever the key and value
    # written here.
    pieces = orjson.dumps(header).split(_DATA_HOLE)
    if len(pieces) != len(outputs) + 1:
        return None
    return (*(piece + b'"data":' for piece in pieces[:-1]), pieces[-1])


def fill_json_answer(
    parts: tuple[bytes, ...], datatypes: list[str], arrays: list[npt.NDArray[Any]]
) -> bytes | None:
    """The answer of :func:`json_answer_parts` with each array as its data, as
    :func:`encode_infer_response` writes it; None when an array holds NaN or an infinity
    (that path writes those)."""
    chunks = [parts[0]]
    for part, datatype, array in zip(parts[1:], datatypes, arrays, strict=True):
        data = orjson.dumps(_json_numbers(datatype, array), option=_JSON_OPTIONS)
        if b"null" in data:
            return None
        chunks += (data, part)
    return b"".join(chunks)


def _all_finite(entries: list[dict[str, Any]]) -> bool:
    for entry in entries:
        data = entry.get("data")
        if isinstance(data, np.ndarray) and data.dtype.kind == "f" and not np.isfinite(data).all():
            return False
    return True


def _dumps_non_finite(header: dict[str, Any]) -> bytes:
    """``header`` as JSON with NaN, Infinity and -Infinity for non-finite floats, as
    Triton writes them and ``tritonclient`` reads them (orjson would write null)."""
    for entry in header["outputs"]:
        if isinstance(entry.get("data"), np.ndarray):
            entry["data"] = entry["data"].tolist()
    return json.dumps(header, allow_nan=True, separators=(",", ":")).encode()


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


def _to_json_data(name: str, datatype: str, array: npt.NDArray[Any]) -> Any:
    if datatype == "BF16":
        raise InvalidInput(
            f"output {name!r}: BF16 can only be returned as binary data; request it with "
            "parameters.binary_data=true"
        )
    if datatype == "BYTES":
        return [_json_string(name, element) for element in array.ravel(order="C").tolist()]
    return _json_numbers(datatype, array)


def _json_numbers(datatype: str, array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    # orjson serializes contiguous native-endian numeric arrays without a Python loop.
    return np.ascontiguousarray(array, dtype=DATATYPES[datatype]).reshape(-1)


def _json_string(name: str, element: object) -> str:
    if not isinstance(element, bytes):
        return str(element)
    try:
        return element.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output {name!r}: BYTES element is not valid UTF-8 and cannot be sent as JSON; "
            "request this output with parameters.binary_data=true"
        ) from None
