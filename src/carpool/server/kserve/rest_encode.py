"""KServe v2 REST answers: JSON, and Triton's binary tensor extension.

An answer is a JSON header, optionally followed by the raw bytes of the outputs asked for
as binary data (:func:`~carpool.server.kserve.tensors.tensor_bytes`, as gRPC sends them)::

    body = [ JSON header (header_length bytes) ][ output 0 bytes ][ output 1 bytes ] ...
             ^ "outputs" in order; a binary output says parameters.binary_data_size

The header length goes back in the ``Inference-Header-Content-Length`` HTTP header
(:mod:`carpool.server.kserve.rest`); without it the whole body is JSON. BF16 goes back
only as binary data. Non-finite floats are written ``NaN``, ``Infinity`` and
``-Infinity``, as Triton writes them and ``tritonclient`` reads them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from carpool.errors import InvalidInput
from carpool.server.kserve.tensors import (
    DATATYPE_NAMES,
    DATATYPES,
    OutputTensor,
    datatype_of,
    tensor_bytes,
)

__all__ = ["encode_infer_response", "fill_json_answer", "json_answer_parts"]

_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


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
