"""The records a front-end worker and the engine exchange: a small header and raw bytes.

::

    [ header length: u32 ][ header: orjson dict ][ array 0 bytes ][ array 1 bytes ] ... [ blob ]

The header says what the record is (``kind``), which request it belongs to (``id``) and,
per array, its name, NumPy dtype, shape and size; ``blob`` is an HTTP body, a chunk of a
streamed answer, or a pickled error. Fixed-size arrays travel as their bytes; an object
array (KServe BYTES) as its elements, each ``[length: u32][kind: b"b" bytes | b"s" str]``
followed by its bytes. Decoded arrays are views on the record's bytes.

A *group* record (INFERS, RESULTS) carries many requests' arrays in one: what one side
wrote for the other in one loop turn (a batch's results for one worker, the requests a
worker read in one turn), so that the header, its parsing and the per-array work are
paid once per group, not per request. Its requests' arrays of one name are joined along
the first axis; the header lists each request's own fields (``items``) and its rows of
each array (``rows``), from which :func:`split_group` gives each request views on its
rows. Only arrays that can be joined (:func:`group_key`: NumPy, not of objects, at
least one axis) go in a group; the others travel in a record of their own.

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
    request whole), COUNTS (the worker's counters), INFERS (a group of INFER). Engine to
    worker: RESULT (arrays), RESULTS (a group of RESULT),
    ERROR, ANSWER (an HTTP answer, or the head of a streamed one), CHUNK, END (a stream's
    end), POLICY (a model's new batch policy)."""

    INFER = 1
    RUN = 2
    CANCEL = 3
    FORWARD = 4
    COUNTS = 5
    INFERS = 6  # a group of INFER
    RESULT = 10
    ERROR = 11
    ANSWER = 12
    CHUNK = 13
    END = 14
    POLICY = 15
    RESULTS = 16  # a group of RESULT


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


GroupKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def group_key(arrays: dict[str, Any]) -> GroupKey | None:
    """What requests whose arrays can go in one group share (names, dtypes, shapes past
    the first axis); None when they cannot (not NumPy, of objects, or no axis)."""
    key = []
    for name, array in arrays.items():
        if type(array) is not np.ndarray or array.dtype.hasobject or not array.ndim:
            return None
        key.append((name, array.dtype.str, array.shape[1:]))
    return tuple(key)


def encode_group(
    kind: Kind, items: list[Any], arrays: list[dict[str, np.ndarray]]
) -> list[bytes | memoryview]:
    """One group record of ``items`` (each request's fields), ``arrays[i]`` item ``i``'s
    arrays, all of one :func:`group_key`."""
    names = list(arrays[0])
    rows = [[len(a[name]) for name in names] for a in arrays]
    if len(arrays) == 1:
        return encode(kind, {"items": items, "rows": rows}, arrays[0])
    joined = {name: np.concatenate([a[name] for a in arrays]) for name in names}
    return encode(kind, {"items": items, "rows": rows}, joined)


def split_group(record: Record) -> list[tuple[Any, dict[str, np.ndarray]]]:
    """Each item of a group record, with views on its rows of the record's arrays."""
    joined = list(record.arrays.items())
    starts = [0] * len(joined)
    out = []
    for item, rows in zip(record.header["items"], record.header["rows"], strict=True):
        arrays = {}
        for i, (name, array) in enumerate(joined):
            start = starts[i]
            end = starts[i] = start + rows[i]
            arrays[name] = array[start:end]
        out.append((item, arrays))
    return out


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
