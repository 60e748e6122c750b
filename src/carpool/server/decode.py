"""Decoding KServe v2 REST inference requests: JSON tensors and the binary extension.

A body is a JSON header, optionally followed by raw tensor bytes (see
:mod:`carpool.server.tensors` for the wire format). A header that carries no tensor data
is parsed and checked once and kept by its bytes (:class:`InferHeader`), since a client
repeats it for every request of one shape. Nothing here knows HTTP.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from carpool.errors import InvalidInput
from carpool.server.classification import class_count_of
from carpool.server.tensors import (
    DATATYPE_NAMES,
    DATATYPES,
    UNSUPPORTED_OUTPUT_PARAMETERS,
    WIRE_DTYPES,
    InferRequest,
    InputTensor,
    RequestedOutput,
    check_empty_shape,
    deserialize_bytes_tensor,
    unsupported_output_parameter,
)

__all__ = [
    "InferHeader",
    "decode_infer_request",
    "decode_json_with_header",
    "decode_with_header",
    "header_of",
    "infer_header",
    "json_shape_key",
    "parse_json_body",
    "parse_json_document",
    "split_infer_body",
]


@dataclass(frozen=True, slots=True)
class _InputSpec:
    """An input's validated header entry, before its data is decoded."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    num_elements: int
    data: list[Any] | None  # JSON data, or None when the data is binary
    binary_size_bytes: int  # 0 for JSON data


def decode_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode a REST inference request body.

    Args:
        body: the whole HTTP body.
        header_length: the Inference-Header-Content-Length header, None when absent (the
            whole body is JSON).

    Raises:
        InvalidInput: the body is malformed; the message names the input and field.
    """
    header_bytes, binary = split_infer_body(body, header_length)
    return decode_with_header(infer_header(header_bytes, header_length is not None), binary)


def infer_header(header_bytes: bytes, is_cacheable: bool = True) -> InferHeader:
    """The request's JSON header parsed and checked; a header that carries no tensor data
    is kept by its bytes, so the next request sending the same header skips the work."""
    header = _HEADERS.get(header_bytes) if is_cacheable else None
    if header is None:
        header = _parse_header(header_bytes)
        if is_cacheable and header.is_cacheable:
            _HEADERS.put(header_bytes, header)
    return header


def decode_with_header(header: InferHeader, binary: memoryview) -> InferRequest:
    """The request of ``header`` with its inputs decoded from ``binary`` (the body after
    the JSON header) or from the header's JSON data."""
    _check_binary_total(header.specs, len(binary))
    return InferRequest(
        request_id=header.request_id,
        inputs=_decode_inputs(header.specs, binary),
        outputs=header.outputs,
        parameters=dict(header.parameters) if header.parameters else {},
        is_binary_output_default=header.is_binary_output_default,
    )


@dataclass(frozen=True, slots=True)
class InferHeader:
    """A request's JSON header, parsed and checked; the tensor data is decoded per body.
    Shared by every request that sends the same header bytes: never mutated."""

    request_id: str | None
    specs: tuple[_InputSpec, ...]
    outputs: tuple[RequestedOutput, ...] | None
    parameters: dict[str, Any]
    is_binary_output_default: bool

    @property
    def is_cacheable(self) -> bool:
        """Whether the header holds no tensor data (every input binary), so the same bytes
        always mean the same request but for the data after them."""
        return all(spec.data is None for spec in self.specs)


class _HeaderCache:
    """The last few parsed binary-request headers by their bytes.

    A client sends the same JSON header with every request of the same shape, so a hit
    skips the JSON parse and every check of this module. Bounded: the oldest entry goes
    first; headers larger than ``MAX_KEY_BYTES`` are never kept.
    """

    SIZE = 256
    MAX_KEY_BYTES = 4096

    def __init__(self) -> None:
        self._entries: dict[bytes, InferHeader] = {}

    def get(self, key: bytes) -> InferHeader | None:
        return self._entries.get(key)

    def put(self, key: bytes, header: InferHeader) -> None:
        if len(key) > self.MAX_KEY_BYTES:
            return
        entries = self._entries
        if len(entries) >= self.SIZE:
            del entries[next(iter(entries))]
        entries[key] = header


_HEADERS = _HeaderCache()


def _parse_header(header: bytes) -> InferHeader:
    return header_of(parse_json_body(header))


def parse_json_body(body: bytes) -> dict[str, Any]:
    """A request's JSON document (the whole body, or the header of a binary one).

    Raises:
        InvalidInput: not JSON, or not a JSON object.
    """
    return parse_json_document(body)[0]


def parse_json_document(body: bytes) -> tuple[dict[str, Any], bool]:
    """(document, is_strict): a request's JSON document, and False when it needed the
    ``NaN``/``Infinity``/``-Infinity`` literals that Triton accepts and ``tritonclient``
    writes for non-finite floats (read then by the standard library; orjson refuses them).

    Raises:
        InvalidInput: not JSON, or not a JSON object.
    """
    try:
        request, is_strict = orjson.loads(body), True
    except orjson.JSONDecodeError as error:
        request, is_strict = _with_non_finite_numbers(body, error), False
    if not isinstance(request, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(request).__name__}")
    return request, is_strict


def _with_non_finite_numbers(body: bytes, error: orjson.JSONDecodeError) -> Any:
    """``body`` read as JSON with NaN and infinities, or the error orjson gave."""
    try:
        document = json.loads(body, parse_int=_int_as_orjson_reads)
        orjson.dumps(document)  # what else the standard library lets through: lone
        # surrogates, nesting deeper than the answer could be written with
    except (ValueError, RecursionError, orjson.JSONEncodeError):
        raise InvalidInput(f"request body is not valid JSON: {error}") from None
    return document


def _int_as_orjson_reads(text: str) -> int | float:
    """A JSON integer as orjson reads it: past 64 bits, a float; so that a document with
    NaN and such an integer is checked as one without NaN is, not refused as invalid
    JSON at the NaN."""
    value = int(text)
    return value if -(2**63) <= value < 2**64 else float(text)


def header_of(request: dict[str, Any]) -> InferHeader:
    """The checked header of a parsed request document.

    Raises:
        InvalidInput: naming the field that is wrong and what was expected.
    """
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f"request 'id' must be a string, got {request_id!r}")
    parameters = _optional_dict(request, "parameters", "request")
    is_binary_default = parameters.get("binary_data_output", False)
    if not isinstance(is_binary_default, bool):
        raise InvalidInput(
            f"request parameters.binary_data_output must be true or false, "
            f"got {is_binary_default!r}"
        )
    return InferHeader(
        request_id=request_id,
        specs=tuple(_input_specs(request.get("inputs"))),
        outputs=_requested_outputs(request.get("outputs"), is_binary_default),
        parameters=parameters,
        is_binary_output_default=is_binary_default,
    )


def json_shape_key(request: dict[str, Any]) -> bytes | None:
    """The request document without its tensor data, as bytes: equal for two JSON requests
    that differ only in their ``data`` lists. None when an input's data is not a list, or
    the document is nested deeper than orjson writes."""
    inputs = request.get("inputs")
    if type(inputs) is not list:
        return None
    stripped = []
    for entry in inputs:
        if type(entry) is not dict or type(entry.get("data")) is not list:
            return None
        stripped.append({k: v for k, v in entry.items() if k != "data"})
    try:
        return orjson.dumps({**request, "inputs": stripped})
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: not planned
        return None


def json_payload(header: InferHeader, request: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
    """``{input name: array}`` decoded from the ``data`` of ``request``, a document with
    the same :func:`json_shape_key` as the one ``header`` was made from."""
    return {
        spec.name: _from_json(spec, entry["data"]).reshape(spec.shape)
        for spec, entry in zip(header.specs, request["inputs"], strict=True)
    }


def decode_json_with_header(header: InferHeader, request: dict[str, Any]) -> InferRequest:
    """The request of ``header`` with its inputs decoded as :func:`json_payload` decodes
    them."""
    payload = json_payload(header, request)
    return InferRequest(
        request_id=header.request_id,
        inputs=tuple(
            InputTensor(spec.name, spec.datatype, spec.shape, payload[spec.name])
            for spec in header.specs
        ),
        outputs=header.outputs,
        parameters=dict(header.parameters) if header.parameters else {},
        is_binary_output_default=header.is_binary_output_default,
    )


def split_infer_body(body: bytes, header_length: int | None) -> tuple[bytes, memoryview]:
    """(JSON header bytes, the binary data after it) of a body."""
    view = memoryview(body)
    if header_length is None:
        return body, view[len(view) :]
    if header_length < 0 or header_length > len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length is {header_length} but the body has "
            f"{len(body)} bytes; expected a length between 0 and {len(body)}"
        )
    return body[:header_length], view[header_length:]


def _optional_dict(entry: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = entry.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} {key!r} must be a JSON object, got {value!r}")
    return value


def _input_specs(inputs: object) -> list[_InputSpec]:
    if not isinstance(inputs, list):
        raise InvalidInput(f"request 'inputs' must be a list of tensors, got {inputs!r}")
    specs: list[_InputSpec] = []
    seen: set[str] = set()
    for index, entry in enumerate(inputs):
        spec = _input_spec(index, entry)
        if spec.name in seen:
            raise InvalidInput(f"input {spec.name!r}: name appears more than once in 'inputs'")
        seen.add(spec.name)
        specs.append(spec)
    return specs


def _named_entry(field: str, index: int, entry: object) -> tuple[dict[str, Any], str]:
    """An entry of ``inputs`` or ``outputs``: a JSON object with a string ``name``."""
    if not isinstance(entry, dict):
        raise InvalidInput(f"{field}[{index}] must be a JSON object, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"{field}[{index}]: 'name' must be a string, got {name!r}")
    return entry, name


def _input_spec(index: int, item: object) -> _InputSpec:
    entry, name = _named_entry("inputs", index, item)
    where = f"input {name!r}"
    datatype = entry.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidInput(f"{where}: datatype {datatype!r} is not one of {DATATYPE_NAMES}")
    shape = _shape(where, entry.get("shape"))
    num_elements = math.prod(shape)
    if not num_elements:
        check_empty_shape(where, datatype, shape)
    parameters = _optional_dict(entry, "parameters", where)
    if "shared_memory_region" in parameters:
        raise InvalidInput(f"{where}: shared memory is not supported; send the data inline")
    binary_size = parameters.get("binary_data_size")
    data = entry.get("data")
    if binary_size is None:
        return _json_input_spec(where, name, datatype, shape, num_elements, data)
    if data is not None:
        raise InvalidInput(f"{where}: has both 'data' and parameters.binary_data_size")
    if not isinstance(binary_size, int) or isinstance(binary_size, bool) or binary_size < 0:
        raise InvalidInput(
            f"{where}: parameters.binary_data_size must be an integer >= 0, got {binary_size!r}"
        )
    if datatype != "BYTES":
        expected = num_elements * WIRE_DTYPES[datatype].itemsize
        if binary_size != expected:
            raise InvalidInput(
                f"{where}: parameters.binary_data_size is {binary_size} bytes but shape "
                f"{list(shape)} of {datatype} needs {expected}"
            )
    return _InputSpec(name, datatype, shape, num_elements, None, binary_size)


def _json_input_spec(
    where: str, name: str, datatype: str, shape: tuple[int, ...], num_elements: int, data: object
) -> _InputSpec:
    if data is None:
        raise InvalidInput(f"{where}: needs 'data' or parameters.binary_data_size")
    if datatype == "BF16":
        raise InvalidInput(
            f"{where}: BF16 data must be sent as binary (parameters.binary_data_size), "
            "not as JSON 'data'"
        )
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: 'data' must be a list, got {type(data).__name__}")
    return _InputSpec(name, datatype, shape, num_elements, data, 0)


def _shape(where: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise InvalidInput(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
    return tuple(shape)


@dataclass(frozen=True, slots=True)
class BinaryLayout:
    """Where each input of a header lies in the binary data after it, for headers whose
    inputs are all fixed-size binary numbers: a planned request's payload is then read
    straight from its bytes (:func:`binary_payload`), without the request's objects."""

    specs: tuple[_InputSpec, ...]
    total: int
    inputs: tuple[tuple[str, np.dtype[Any], np.dtype[Any], int, tuple[int, ...], int], ...]


def binary_layout(header: InferHeader) -> BinaryLayout | None:
    """The layout of ``header``'s binary inputs; None when an input is JSON, BYTES or BF16
    (those take :func:`decode_with_header`)."""
    inputs = []
    offset = 0
    for spec in header.specs:
        if spec.data is not None or spec.datatype in ("BYTES", "BF16"):
            return None
        wire, dtype = WIRE_DTYPES[spec.datatype], DATATYPES[spec.datatype]
        inputs.append((spec.name, wire, dtype, spec.num_elements, spec.shape, offset))
        offset += spec.binary_size_bytes
    return BinaryLayout(header.specs, offset, tuple(inputs))


def binary_payload(layout: BinaryLayout, binary: memoryview) -> dict[str, npt.NDArray[Any]]:
    """``{input name: array}`` read from ``binary`` as :func:`decode_with_header` reads it
    (each array a copy: the body is immutable and its offsets unaligned).

    Raises:
        InvalidInput: the binary data's size is not what the header declares.
    """
    if len(binary) != layout.total:
        _check_binary_total(layout.specs, len(binary))
    return {
        name: np.frombuffer(binary, wire, count, offset).astype(dtype).reshape(shape)
        for name, wire, dtype, count, shape, offset in layout.inputs
    }


def _check_binary_total(specs: tuple[_InputSpec, ...], num_binary_bytes: int) -> None:
    total = sum(spec.binary_size_bytes for spec in specs)
    if total != num_binary_bytes:
        raise InvalidInput(
            f"inputs declare {total} bytes of binary data (parameters.binary_data_size) but "
            f"the body has {num_binary_bytes} bytes after the JSON header"
        )


def _decode_inputs(specs: tuple[_InputSpec, ...], binary: memoryview) -> tuple[InputTensor, ...]:
    tensors: list[InputTensor] = []
    offset = 0
    for spec in specs:
        if spec.data is None:
            chunk = binary[offset : offset + spec.binary_size_bytes]
            offset += spec.binary_size_bytes
            flat = _from_binary(spec, chunk)
        else:
            flat = _from_json(spec, spec.data)
        tensors.append(InputTensor(spec.name, spec.datatype, spec.shape, flat.reshape(spec.shape)))
    return tuple(tensors)


def _from_binary(spec: _InputSpec, chunk: memoryview) -> npt.NDArray[Any]:
    if spec.datatype == "BYTES":
        what = f"input {spec.name!r}: binary BYTES data"
        return deserialize_bytes_tensor(chunk, spec.num_elements, what=what)
    # Copy: the body is immutable and its offsets unaligned; models want owned arrays.
    wire = np.frombuffer(chunk, dtype=WIRE_DTYPES[spec.datatype], count=spec.num_elements)
    if spec.datatype == "BF16":
        return (wire.astype(np.uint32) << 16).view(np.float32)
    return wire.astype(DATATYPES[spec.datatype], copy=True)


def _from_json(spec: _InputSpec, data: list[Any]) -> npt.NDArray[Any]:
    flat = _flat_numbers(spec, data)
    return flat if flat is not None else _from_json_lists(spec, data)


def _from_json_lists(spec: _InputSpec, data: list[Any]) -> npt.NDArray[Any]:
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


def _flat_numbers(spec: _InputSpec, data: list[Any]) -> npt.NDArray[Any] | None:
    """A flat list of numbers as the array of ``spec``, packed by ``struct`` (about three
    times faster than ``np.array`` on a list of floats); None when the list is not such a
    list (nested, strings, bools, a value out of range), which the general path then
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


def _cast_json_numbers(
    where: str, datatype: str, parsed: npt.NDArray[Any], data: list[Any]
) -> npt.NDArray[Any]:
    dtype = DATATYPES[datatype]
    kind = parsed.dtype.kind
    if dtype.kind == "b":
        if kind != "b":
            raise InvalidInput(f"{where}: BOOL data must be true or false")
        return parsed
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
        values = np.array(data, dtype=object).reshape(-1).tolist()
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
    values = np.array(data, dtype=object).reshape(-1).tolist()
    if not all(type(value) in (int, float, bool) for value in values):
        raise InvalidInput(f"{where}: {datatype} data must be numbers")
    return np.array(values, dtype=np.float64)


def _requested_outputs(
    outputs: object, is_binary_default: bool
) -> tuple[RequestedOutput, ...] | None:
    if outputs is None or outputs == []:  # none named: all outputs, as in Triton
        return None
    if not isinstance(outputs, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {outputs!r}")
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, item in enumerate(outputs):
        entry, name = _named_entry("outputs", index, item)
        where = f"output {name!r}"
        if name in seen:
            raise InvalidInput(f"{where}: name appears more than once in 'outputs'")
        seen.add(name)
        parameters = _optional_dict(entry, "parameters", where)
        for unsupported in UNSUPPORTED_OUTPUT_PARAMETERS:
            if parameters.get(unsupported):
                raise unsupported_output_parameter(where, unsupported, parameters[unsupported])
        is_binary = parameters.get("binary_data", is_binary_default)
        if not isinstance(is_binary, bool):
            raise InvalidInput(
                f"{where}: parameters.binary_data must be true or false, got {is_binary!r}"
            )
        count = parameters.get("classification")
        class_count = 0 if count is None else class_count_of(where, count, minimum=0)
        requested.append(RequestedOutput(name, is_binary, class_count))
    return tuple(requested)
