"""The records a front-end worker and the engine exchange: a small header and raw bytes.

::

    [ header length: u32 ][ header: orjson dict ][ array 0 bytes ][ array 1 bytes ] ... [ blob ]

The header says what the record is (``kind``), which request it belongs to (``id``) and,
per array, its name, NumPy dtype, shape and size; ``blob`` is an HTTP body, a chunk of a
streamed answer, or a pickled error. Fixed-size arrays travel as their bytes; an object
array (KServe BYTES) as its elements, each ``[length: u32][kind: b"b" bytes | b"s" str]``
followed by its bytes. Decoded arrays are views on the record's bytes.

An error crosses as its pickle when it is carpool's (its fields rebuild it exactly, so
the worker answers it with the status, message and headers :mod:`carpool.server.errors`
gives it); any other exception as its type's name and its message, rebuilt as an
exception of a class of the same name, which the worker answers as the engine would
have: a 500 naming that type.
"""

from __future__ import annotations

import enum
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from carpool.errors import CarpoolError

_U32 = struct.Struct("<I")
_ELEMENT = struct.Struct("<Ic")


class Kind(enum.IntEnum):
    """What a record is. Worker to engine: INFER (arrays), RUN (arrays, through the
    model's own ``run``: embeddings and generation models), CANCEL, FORWARD (an HTTP
    request whole), COUNTS (the worker's counters). Engine to worker: RESULT (arrays),
    ERROR, ANSWER (an HTTP answer, or the head of a streamed one), CHUNK, END (a stream's
    end), POLICY (a model's new batch policy)."""

    INFER = 1
    RUN = 2
    CANCEL = 3
    FORWARD = 4
    COUNTS = 5
    RESULT = 10
    ERROR = 11
    ANSWER = 12
    CHUNK = 13
    END = 14
    POLICY = 15


_KINDS = {int(kind): kind for kind in Kind}


@dataclass(slots=True)
class Record:
    """A decoded record: its ``kind``, its ``header`` (with, for a request's records,
    ``id``), its ``arrays`` by name, and its ``blob``."""

    kind: Kind
    header: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    blob: bytes | memoryview = b""


def encode(
    kind: Kind,
    header: dict[str, Any],
    arrays: dict[str, Any] | None = None,
    blob: bytes = b"",
) -> list[bytes | memoryview]:
    """A record's parts, ready to be written one after the other."""
    parts: list[bytes | memoryview] = []
    specs = []
    for name, value in (arrays or {}).items():
        array = value if type(value) is np.ndarray else np.asarray(value)
        if array.dtype.hasobject:
            data = _elements(array)
            specs.append((name, "O", array.shape, len(data)))
            parts.append(data)
            continue
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        specs.append((name, array.dtype.str, array.shape, array.nbytes))
        parts.append(array.data.cast("B") if array.nbytes and array.ndim else array.tobytes())
    document = orjson.dumps({**header, "kind": int(kind), "arrays": specs, "blob": len(blob)})
    return [_U32.pack(len(document)), document, *parts, blob]


def decode(record: bytes | bytearray) -> Record:
    """The record ``encode`` made, arrays as views on ``record`` (writable when it
    is a bytearray)."""
    size = _U32.unpack_from(record, 0)[0]
    at = _U32.size + size
    header = orjson.loads(record[_U32.size : at])
    view = memoryview(record)
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape, nbytes in header.pop("arrays"):
        data = view[at : at + nbytes]
        if dtype == "O":
            arrays[name] = _from_elements(data, tuple(shape))
        else:
            arrays[name] = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        at += nbytes
    blob_bytes = header.pop("blob")
    return Record(_KINDS[header["kind"]], header, arrays, view[at : at + blob_bytes])


def _elements(array: np.ndarray) -> bytes:
    chunks = []
    for item in array.reshape(-1):
        if isinstance(item, str):
            data, tag = item.encode(), b"s"
        else:
            data, tag = bytes(item), b"b"
        chunks.append(_ELEMENT.pack(len(data), tag))
        chunks.append(data)
    return b"".join(chunks)


def _from_elements(data: memoryview, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    out = np.empty(count, dtype=object)
    at = 0
    for i in range(count):
        size, tag = _ELEMENT.unpack_from(data, at)
        at += _ELEMENT.size
        raw = bytes(data[at : at + size])
        out[i] = raw.decode() if tag == b"s" else raw
        at += size
    return out.reshape(shape)


def encode_error(exc: BaseException) -> bytes:
    """``exc`` as bytes :func:`decode_error` rebuilds."""
    if isinstance(exc, CarpoolError):
        try:
            return b"P" + pickle.dumps(exc)
        except Exception:  # a field that does not pickle: sent as any other exception
            pass
    return b"N" + orjson.dumps([type(exc).__name__, str(exc)])


def decode_error(data: bytes | memoryview) -> Exception:
    """The error :func:`encode_error` sent."""
    raw = bytes(data)
    if raw[:1] == b"P":
        error = pickle.loads(raw[1:])
        assert isinstance(error, Exception), "encode_error pickles exceptions only"
        return error
    name, message = orjson.loads(raw[1:])
    return _remote_class(name)(message)


_REMOTE_CLASSES: dict[str, type[Exception]] = {}


def _remote_class(name: str) -> type[Exception]:
    """An exception class named ``name``: the error message names the engine's type."""
    cls = _REMOTE_CLASSES.get(name)
    if cls is None:
        cls = _REMOTE_CLASSES[name] = type(name, (Exception,), {})
    return cls
