"""KServe v2 REST requests: a JSON document, or Triton's binary tensor extension.

A body is a JSON header, optionally followed by raw tensor bytes::

    body = [ JSON header (header_length bytes) ][ tensor 0 bytes ][ tensor 1 bytes ] ...
             ^ "inputs" in order; a binary tensor says parameters.binary_data_size

The header length travels in the ``Inference-Header-Content-Length`` HTTP header; without
it the whole body is JSON. The header is parsed and checked into an :class:`InferHeader`
(its inputs' specs, the outputs asked for, the parameters), then each body's tensors are
decoded against it: raw bytes by :func:`~carpool.server.kserve.tensors.array_from_raw`,
as gRPC's are, JSON ``data`` by :func:`~carpool.server.kserve.json_data.array_from_json`.
A header with no tensor data in it means the same for every body sent after it, so
:mod:`carpool.server.kserve.rest` plans it once (:func:`binary_layout`). Nothing here knows
HTTP or the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from carpool.errors import InvalidInput
from carpool.server.classification import class_count_of
from carpool.server.kserve.json_data import array_from_json
from carpool.server.kserve.requested import requested_outputs
from carpool.server.kserve.tensors import (
    DATATYPE_NAMES,
    DATATYPES,
    WIRE_DTYPES,
    InferRequest,
    InputTensor,
    RequestedOutput,
    array_from_raw,
    check_empty_shape,
    check_num_dims,
    numbers_from_raw,
)

__all__ = [
    "BinaryLayout",
    "InferHeader",
    "InputSpec",
    "binary_layout",
    "binary_payload",
    "decode_infer_request",
    "decode_json_with_header",
    "decode_with_header",
    "header_of",
    "json_payload",
    "json_shape_key",
    "parse_json_document",
    "split_infer_body",
]


@dataclass(frozen=True, slots=True)
class InputSpec:
    """An input's checked header entry, before its data is decoded."""

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
    return decode_with_header(header_of(parse_json_document(header_bytes)[0]), binary)


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
    specs: tuple[InputSpec, ...]
    outputs: tuple[RequestedOutput, ...] | None
    parameters: dict[str, Any]
    is_binary_output_default: bool

    @property
    def is_cacheable(self) -> bool:
        """Whether the header holds no tensor data (every input binary), so the same bytes
        always mean the same request but for the data after them: a plan may keep it."""
        return all(spec.data is None for spec in self.specs)


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
        spec.name: array_from_json(spec, entry["data"]).reshape(spec.shape)
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


def _input_specs(inputs: object) -> list[InputSpec]:
    if not isinstance(inputs, list):
        raise InvalidInput(f"request 'inputs' must be a list of tensors, got {inputs!r}")
    specs: list[InputSpec] = []
    seen: set[str] = set()
    for index, entry in enumerate(inputs):
        spec = _input_spec(index, entry)
        if spec.name in seen:
            raise InvalidInput(f"input {spec.name!r}: name appears more than once in 'inputs'")
        seen.add(spec.name)
        specs.append(spec)
    return specs


def _named_entry(field: str, index: int, entry: object) -> tuple[str, dict[str, Any]]:
    """(name, entry) of an entry of ``inputs`` or ``outputs``: a JSON object with a string
    ``name``."""
    if not isinstance(entry, dict):
        raise InvalidInput(f"{field}[{index}] must be a JSON object, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"{field}[{index}]: 'name' must be a string, got {name!r}")
    return name, entry


def _input_spec(index: int, item: object) -> InputSpec:
    name, entry = _named_entry("inputs", index, item)
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
    return InputSpec(name, datatype, shape, num_elements, None, binary_size)


def _json_input_spec(
    where: str, name: str, datatype: str, shape: tuple[int, ...], num_elements: int, data: object
) -> InputSpec:
    if data is None:
        raise InvalidInput(f"{where}: needs 'data' or parameters.binary_data_size")
    if datatype == "BF16":
        raise InvalidInput(
            f"{where}: BF16 data must be sent as binary (parameters.binary_data_size), "
            "not as JSON 'data'"
        )
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: 'data' must be a list, got {type(data).__name__}")
    return InputSpec(name, datatype, shape, num_elements, data, 0)


def _shape(where: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise InvalidInput(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
    check_num_dims(where, tuple(shape))
    return tuple(shape)


@dataclass(frozen=True, slots=True)
class BinaryLayout:
    """Where each input of a header lies in the binary data after it, for headers whose
    inputs are all fixed-size binary numbers: a planned request's payload is then read
    straight from its bytes (:func:`binary_payload`), without the request's objects;
    per input its name, wire and NumPy dtypes, count, shape and offset."""

    specs: tuple[InputSpec, ...]
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
        name: numbers_from_raw(binary, wire, dtype, count, offset).reshape(shape)
        for name, wire, dtype, count, shape, offset in layout.inputs
    }


def _check_binary_total(specs: tuple[InputSpec, ...], num_binary_bytes: int) -> None:
    total = sum(spec.binary_size_bytes for spec in specs)
    if total != num_binary_bytes:
        raise InvalidInput(
            f"inputs declare {total} bytes of binary data (parameters.binary_data_size) but "
            f"the body has {num_binary_bytes} bytes after the JSON header"
        )


def _decode_inputs(specs: tuple[InputSpec, ...], binary: memoryview) -> tuple[InputTensor, ...]:
    tensors: list[InputTensor] = []
    offset = 0
    for spec in specs:
        if spec.data is None:
            chunk = binary[offset : offset + spec.binary_size_bytes]
            offset += spec.binary_size_bytes
            flat = array_from_raw(
                chunk, spec.datatype, spec.num_elements, name=spec.name, source="binary"
            )
        else:
            flat = array_from_json(spec, spec.data)
        tensors.append(InputTensor(spec.name, spec.datatype, spec.shape, flat.reshape(spec.shape)))
    return tuple(tensors)


def _requested_outputs(
    outputs: object, is_binary_default: bool
) -> tuple[RequestedOutput, ...] | None:
    if outputs is None or outputs == []:  # none named: all outputs, as in Triton
        return None
    if not isinstance(outputs, list):
        raise InvalidInput(f"request 'outputs' must be a list, got {outputs!r}")
    return requested_outputs(
        (_named_entry("outputs", index, item) for index, item in enumerate(outputs)),
        is_binary_default=is_binary_default,
        parameters_of=_output_parameters,
        class_count_of=_class_count,
    )


def _output_parameters(where: str, entry: dict[str, Any]) -> dict[str, Any]:
    return _optional_dict(entry, "parameters", where)


def _class_count(where: str, value: object) -> int:
    """REST's ``classification``: an integer >= 0, 0 meaning the tensor itself (Triton's
    default count)."""
    return class_count_of(where, value, minimum=0)
