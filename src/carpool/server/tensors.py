"""KServe v2 (Open Inference Protocol) tensors over REST, with Triton's binary extension.

A request or response body is a JSON header, optionally followed by raw tensor bytes::

    body = [ JSON header (header_length bytes) ][ tensor 0 bytes ][ tensor 1 bytes ] ...
             ^ "inputs"/"outputs" in order; a binary tensor says parameters.binary_data_size

The header length travels in the ``Inference-Header-Content-Length`` HTTP header; without
it the whole body is JSON. Fixed-size tensors are raw little-endian row-major values; a
BYTES tensor is, per element in row-major order, a 4-byte little-endian length then the
bytes. BF16 travels only in binary (2 bytes per value) and is decoded to float32.

Nothing here knows HTTP: the server hands in the body and the header value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from carpool.errors import InvalidInput

__all__ = [
    "DATATYPES",
    "InferHeader",
    "InferRequest",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "datatype_of",
    "decode_infer_request",
    "decode_json_with_header",
    "decode_with_header",
    "deserialize_bytes_tensor",
    "encode_infer_response",
    "header_of",
    "infer_header",
    "json_shape_key",
    "parse_json_body",
    "serialize_bytes_tensor",
    "split_infer_body",
    "tensor_bytes",
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

_KNOWN = ", ".join(DATATYPES)
# Wire dtypes of the fixed-size types: little-endian whatever the host.
_WIRE: dict[str, np.dtype[Any]] = {
    name: dtype.newbyteorder("<")
    for name, dtype in DATATYPES.items()
    if name not in ("BYTES", "BF16")
}
_WIRE["BF16"] = np.dtype("<u2")
_NAME_OF: dict[np.dtype[Any], str] = {
    dtype: name for name, dtype in DATATYPES.items() if name not in ("BYTES", "BF16")
}
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_LENGTH_PREFIX_BYTES = 4


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
        raise InvalidInput(f"array dtype {dtype} has no KServe datatype; expected one of {_KNOWN}")
    return name


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
    """An output the client asked for, and whether it wants it as binary data."""

    name: str
    is_binary: bool


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


@dataclass(frozen=True, slots=True)
class _InputSpec:
    """An input's validated header entry, before its data is decoded."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    num_elements: int
    data: list[Any] | None  # JSON data, or None when the data is binary
    binary_size_bytes: int  # 0 for JSON data


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
# Requests


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
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"request body is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(request).__name__}")
    return request


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
    that differ only in their ``data`` lists (and never equal to a binary request's
    header). None when an input's data is not a list."""
    inputs = request.get("inputs")
    if type(inputs) is not list:
        return None
    stripped = []
    for entry in inputs:
        if type(entry) is not dict or type(entry.get("data")) is not list:
            return None
        stripped.append({k: v for k, v in entry.items() if k != "data"})
    return b"json:" + orjson.dumps({**request, "inputs": stripped})


def decode_json_with_header(header: InferHeader, request: dict[str, Any]) -> InferRequest:
    """The request of ``header`` with its inputs decoded from the ``data`` of ``request``,
    a document with the same :func:`json_shape_key` as the one ``header`` was made from."""
    tensors = []
    for spec, entry in zip(header.specs, request["inputs"], strict=True):
        flat = _from_json(spec, entry["data"])
        tensors.append(InputTensor(spec.name, spec.datatype, spec.shape, flat.reshape(spec.shape)))
    return InferRequest(
        request_id=header.request_id,
        inputs=tuple(tensors),
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


def _input_spec(index: int, entry: object) -> _InputSpec:
    if not isinstance(entry, dict):
        raise InvalidInput(f"inputs[{index}] must be a JSON object, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{index}]: 'name' must be a string, got {name!r}")
    where = f"input {name!r}"
    datatype = entry.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InvalidInput(f"{where}: datatype {datatype!r} is not one of {_KNOWN}")
    shape = _shape(where, entry.get("shape"))
    num_elements = math.prod(shape)
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
        expected = num_elements * _WIRE[datatype].itemsize
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
    wire = np.frombuffer(chunk, dtype=_WIRE[spec.datatype], count=spec.num_elements)
    if spec.datatype == "BF16":
        return (wire.astype(np.uint32) << 16).view(np.float32)
    return wire.astype(DATATYPES[spec.datatype], copy=True)


def _from_json(spec: _InputSpec, data: list[Any]) -> npt.NDArray[Any]:
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
        if kind not in "iuf":
            raise InvalidInput(f"{where}: {datatype} data must be numbers")
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


def _requested_outputs(
    outputs: object, is_binary_default: bool
) -> tuple[RequestedOutput, ...] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {outputs!r}")
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, entry in enumerate(outputs):
        if not isinstance(entry, dict):
            raise InvalidInput(f"outputs[{index}] must be a JSON object, got {entry!r}")
        name = entry.get("name")
        if not isinstance(name, str):
            raise InvalidInput(f"outputs[{index}]: 'name' must be a string, got {name!r}")
        where = f"output {name!r}"
        if name in seen:
            raise InvalidInput(f"{where}: name appears more than once in 'outputs'")
        seen.add(name)
        parameters = _optional_dict(entry, "parameters", where)
        for unsupported in ("classification", "shared_memory_region"):
            if parameters.get(unsupported):
                raise InvalidInput(f"{where}: parameters.{unsupported} is not supported")
        is_binary = parameters.get("binary_data", is_binary_default)
        if not isinstance(is_binary, bool):
            raise InvalidInput(
                f"{where}: parameters.binary_data must be true or false, got {is_binary!r}"
            )
        requested.append(RequestedOutput(name, is_binary))
    return tuple(requested)


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
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if request_id is not None:
        header["id"] = request_id
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for output in outputs:
        datatype = output.datatype or datatype_of(output.array)
        if datatype not in DATATYPES:
            raise InvalidInput(
                f"output {output.name!r}: datatype {datatype!r} is not one of {_KNOWN}"
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
    if not chunks:
        return json_header, None
    return b"".join([json_header, *chunks]), len(json_header)


def tensor_bytes(datatype: str, array: npt.NDArray[Any]) -> bytes:
    """``array`` as KServe binary data of ``datatype``."""
    if datatype == "BYTES":
        return serialize_bytes_tensor(array)
    if datatype == "BF16":
        return _bf16_bits(array).tobytes()
    return np.ascontiguousarray(array, dtype=_WIRE[datatype]).tobytes()


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
