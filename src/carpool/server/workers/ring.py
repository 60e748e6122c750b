"""A single-producer, single-consumer byte ring in shared memory: one direction of the
channel between a front-end worker and the engine (:mod:`carpool.server.workers.channel`).

::

    shared memory:  [ consumed: u64 | pad to 64 ][ data: capacity bytes ..................]
    a record:       [ length: u32 ][ length bytes ]     (never split at the data's end)
    at the end:     [ 0xFFFFFFFF ] "go back to the start", or fewer than 4 bytes left

Positions only grow (u64 byte counts, taken modulo the capacity). The writer owns the
write position and sends it to the reader over a socket (that send orders the memory: the
reader reads up to the position it was sent, never further); the reader owns the consumed
position and stores it in the header, from where the writer learns what it may reuse. A
record that does not fit now (the ring is full, or the record is larger than the ring) is
not written: :meth:`Ring.write` returns False and the caller sends it another way.
"""

from __future__ import annotations

import contextlib
import struct
from multiprocessing import shared_memory

HEADER_BYTES = 64
LENGTH_BYTES = 4
_WRAP = 0xFFFFFFFF
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Ring:
    """One end of a ring (either end: the writer calls :meth:`write`, the reader
    :meth:`read_to`). ``create``: make the shared memory (its owner unlinks it on
    :meth:`close`); else attach to the one named ``name``."""

    def __init__(self, name: str | None, capacity_bytes: int, *, create: bool) -> None:
        if create and capacity_bytes < 2 * LENGTH_BYTES:
            raise ValueError(f"capacity_bytes={capacity_bytes}: expected at least 8")
        self._shm = shared_memory.SharedMemory(
            name, create=create, size=HEADER_BYTES + capacity_bytes if create else 0
        )
        self._is_owner = create
        self.capacity_bytes = capacity_bytes
        buf = self._shm.buf
        assert buf is not None, "a mapped shared memory block has a buffer"
        self._buf = buf
        self._data = self._buf[HEADER_BYTES : HEADER_BYTES + capacity_bytes]
        if create:
            _U64.pack_into(self._buf, 0, 0)
        self.write_pos = 0  # the writer's
        self.read_pos = 0  # the reader's

    @property
    def name(self) -> str:
        return self._shm.name

    # -- the writer ----------------------------------------------------------------------

    def write(self, parts: list[bytes | memoryview], size: int | None = None) -> bool:
        """Append one record made of ``parts`` (``size`` bytes in all, counted if None);
        False (nothing written) when it does not fit in the space the reader has freed."""
        if size is None:
            size = sum(map(len, parts))
        capacity = self.capacity_bytes
        need = LENGTH_BYTES + size
        if need > capacity:
            return False
        consumed = _U64.unpack_from(self._buf, 0)[0]
        pos = self.write_pos
        offset = pos % capacity
        tail = capacity - offset
        skip = tail if tail < need else 0  # the record starts again at the beginning
        if pos + skip + need - consumed > capacity:
            return False
        data = self._data
        if skip:
            if tail >= LENGTH_BYTES:
                _U32.pack_into(data, offset, _WRAP)
            offset = 0
        _U32.pack_into(data, offset, size)
        at = offset + LENGTH_BYTES
        for part in parts:
            end = at + len(part)
            data[at:end] = part
            at = end
        self.write_pos = pos + skip + need
        return True

    # -- the reader ----------------------------------------------------------------------

    def read_to(self, end_pos: int) -> list[bytearray]:
        """The records written up to ``end_pos`` (a position the writer sent), copied
        out (writable: NumPy views on them are too); their space is given back to the
        writer."""
        records: list[bytearray] = []
        capacity, data = self.capacity_bytes, self._data
        pos = self.read_pos
        while pos < end_pos:
            offset = pos % capacity
            tail = capacity - offset
            if tail < LENGTH_BYTES:
                pos += tail
                continue
            size = _U32.unpack_from(data, offset)[0]
            if size == _WRAP:
                pos += tail
                continue
            start = offset + LENGTH_BYTES
            records.append(bytearray(data[start : start + size]))
            pos += LENGTH_BYTES + size
        self.read_pos = pos
        _U64.pack_into(self._buf, 0, pos)
        return records

    def close(self) -> None:
        """Let go of the shared memory (and unlink it, at the end that made it)."""
        self._data.release()
        self._buf = memoryview(b"")
        self._shm.close()
        if self._is_owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
