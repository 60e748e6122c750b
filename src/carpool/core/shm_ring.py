"""Batches between processes through shared memory: arrays in a region, a header on a pipe.

A process replica (:mod:`carpool.core.process_replica`) and the server process each own a
:class:`Region`, a block of shared memory that grows when a payload does not fit. The
writer copies a NumPy payload (one array, or a dict of arrays) into its region and sends
only a small :class:`Header` (region name, and per array its key, dtype, shape and
offset); the reader attaches to the region by name and builds NumPy views on it. A CPU
torch tensor crosses the same way and is read back as a tensor on the region's memory
(``torch.from_numpy``). Anything else (a list of strings, a GPU or bfloat16 tensor,
arrays of Python objects) travels in the header itself, pickled over the pipe.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

log = logging.getLogger("carpool.replicas")

ALIGN_BYTES = 64  # each array starts on a cache line
INITIAL_REGION_BYTES = 1 << 20


class PayloadKind(enum.Enum):
    ARRAY = "array"  # one array
    DICT = "dict"  # a dict of str -> array
    PICKLED = "pickled"  # anything else, in the header


@dataclass(frozen=True, slots=True)
class ArraySlot:
    """Where one array lies in a region: ``key`` is its dict key (None for one array)."""

    key: str | None
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    is_torch: bool = False  # a CPU torch tensor: read back as one (torch.from_numpy)


@dataclass(frozen=True, slots=True)
class Header:
    """What crosses the pipe for one payload: the region and its slots, or the payload
    itself (``pickled``) when it is not NumPy arrays."""

    kind: PayloadKind
    region: str | None
    slots: tuple[ArraySlot, ...]
    pickled: Any = None


def _as_array(value: object) -> np.ndarray | None:
    """``value`` as a NumPy array to copy into a region (a CPU torch tensor's own memory,
    without a copy), or None when it must be pickled."""
    if isinstance(value, np.ndarray):
        return None if value.dtype.hasobject else value
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and not value.requires_grad
        and value.dtype != torch.bfloat16  # NumPy has no bfloat16
    ):
        array: np.ndarray = value.numpy()
        return array
    return None


def _arrays(payload: Any) -> tuple[PayloadKind, list[tuple[str | None, np.ndarray, bool]]] | None:
    """The arrays a payload is made of (key, array, whether it was a torch tensor), or
    None when it must be pickled."""
    if not isinstance(payload, dict):
        array = _as_array(payload)
        if array is None:
            return None
        return PayloadKind.ARRAY, [(None, array, array is not payload)]
    found: list[tuple[str | None, np.ndarray, bool]] = []
    for key, value in payload.items():
        array = _as_array(value)
        if not isinstance(key, str) or array is None:
            return None
        found.append((key, array, array is not value))
    return PayloadKind.DICT, found


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


class Region:
    """A shared-memory region one side writes payloads into, grown (a new region, the old
    one unlinked) when a payload does not fit. The reader must be done with a payload
    before the next one is written: a replica runs one call at a time."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None

    @property
    def name(self) -> str | None:
        return None if self._shm is None else self._shm.name

    def write(self, payload: Any) -> Header:
        """Copy ``payload``'s arrays into the region; the header says where they lie."""
        found = _arrays(payload)
        if found is None:
            return Header(PayloadKind.PICKLED, None, (), payload)
        kind, arrays = found
        slots: list[ArraySlot] = []
        offset = 0
        for key, array, is_torch in arrays:
            slots.append(ArraySlot(key, array.dtype.str, array.shape, offset, is_torch))
            offset += _aligned(array.nbytes)
        shm = self._fit(offset)
        for slot, (_, array, _) in zip(slots, arrays, strict=True):
            view = np.ndarray(slot.shape, array.dtype, buffer=shm.buf, offset=slot.offset_bytes)
            view[...] = array
            del view
        return Header(kind, shm.name, tuple(slots))

    def _fit(self, num_bytes: int) -> shared_memory.SharedMemory:
        shm = self._shm
        if shm is not None and shm.size >= num_bytes:
            return shm
        size = max(INITIAL_REGION_BYTES, 2 * (shm.size if shm is not None else 0), num_bytes)
        self.close()
        self._shm = shared_memory.SharedMemory(create=True, size=size)
        return self._shm

    def close(self) -> None:
        """Unlink the region (a reader's mapping stays valid until it closes it)."""
        shm, self._shm = self._shm, None
        if shm is not None:
            _close(shm)
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


class Reader:
    """Builds payloads from headers, attached to the region the other side names last."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None

    def read(self, header: Header, *, copy: bool) -> Any:
        """The payload ``header`` describes: views on the region, or copies of them
        (``copy``) when the region is written again before the payload is dropped."""
        if header.kind is PayloadKind.PICKLED:
            return header.pickled
        assert header.region is not None
        shm = self._attach(header.region)
        arrays: list[Any] = []
        for slot in header.slots:
            view = np.ndarray(slot.shape, np.dtype(slot.dtype), shm.buf, slot.offset_bytes)
            array = view.copy() if copy else view
            if slot.is_torch:
                import torch

                arrays.append(torch.from_numpy(array))
            else:
                arrays.append(array)
        if header.kind is PayloadKind.ARRAY:
            return arrays[0]
        return {slot.key: array for slot, array in zip(header.slots, arrays, strict=True)}

    def _attach(self, name: str) -> shared_memory.SharedMemory:
        shm = self._shm
        if shm is not None and shm.name == name:
            return shm
        self.close()
        self._shm = shared_memory.SharedMemory(name=name)
        return self._shm

    def unlink(self) -> None:
        """Unlink the region last read (its writer died without unlinking it)."""
        shm = self._shm
        if shm is not None:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        self.close()

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            _close(shm)


def _close(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view on it is still held (by the model): the mapping stays
        log.debug("shared memory %s still has views; its mapping is kept", shm.name)
