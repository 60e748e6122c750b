"""Batch buffers reused batch after batch instead of allocated afresh (``buffer_pool: true``).

A buffer is kept per *key*: what the collator writes (NumPy or torch, the dtype and
trailing shape of the input signature, the device) and a *size bucket*, the rows rounded up
to the next preferred batch size, else to the next power of two::

    batch of 5 rows, preferred sizes (4, 8)   ->  bucket 8: a [8, ...] buffer, the batch is
                                                  its first 5 rows (a contiguous view)
    batch of 5 rows, no preferred sizes       ->  bucket 8 (the next power of two)

A call *leases* a buffer (:meth:`BufferPool.acquire`) for as long as the model runs on it
and gives it back (:meth:`BufferPool.release`) once its outputs are split; with two calls
in flight on a replica each has its own. The pool keeps at most ``budget_bytes`` of idle
buffers: a buffer given back that would pass the budget first evicts the least recently
used buckets. A lease never given back (a call that failed, or hung) is left to the
garbage collector, and that bucket's next batch allocates again (a miss).

On a CUDA replica, host buffers are *pinned* (page-locked), so that the copy to the
device may run asynchronously (``non_blocking=True``); where torch has no CUDA the pool
logs once and keeps ordinary memory.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.errors import ConfigError

log = logging.getLogger("carpool.buffer_pool")

DEFAULT_BUFFER_POOL_MB = 256.0


def bucket_rows(rows: int, preferred: Sequence[int] = ()) -> int:
    """The bucket a batch of ``rows`` rows is kept in: the smallest preferred batch size
    that holds it, else the next power of two (``rows`` itself when it is one)."""
    if preferred:
        at = bisect.bisect_left(preferred, rows)
        if at < len(preferred):
            return int(preferred[at])
    return 1 << max(rows - 1, 0).bit_length()


def check_pool_options(buffer_pool: object, buffer_pool_mb: object) -> None:
    """Refuse a ``buffer_pool`` that is not a bool or a ``buffer_pool_mb`` that is not a
    positive, finite number of MiB.

    Raises:
        ConfigError: naming the option and what it may be.
    """
    if not isinstance(buffer_pool, bool):
        raise ConfigError("buffer_pool", buffer_pool, "true or false")
    if (
        isinstance(buffer_pool_mb, bool)
        or not isinstance(buffer_pool_mb, int | float)
        or not 0 < buffer_pool_mb < float("inf")
    ):
        raise ConfigError("buffer_pool_mb", buffer_pool_mb, "a finite number of MiB > 0")


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What the pool did: ``hits`` (a batch reused a kept buffer), ``misses`` (it
    allocated one), ``evictions`` (buffers dropped to keep within the budget),
    ``bytes_held`` (idle buffers kept now) and ``budget_bytes``."""

    hits: int
    misses: int
    evictions: int
    bytes_held: int
    budget_bytes: int
    num_buffers: int


def _nbytes(buffer: Any) -> int:
    nbytes = getattr(buffer, "nbytes", None)
    if nbytes is None:  # torch < 2.1 tensors
        return int(buffer.numel() * buffer.element_size())
    return int(nbytes)


class BufferPool:
    """Idle batch buffers by key, least recently used first; thread safe.

    Args:
        budget_bytes: most bytes of idle buffers kept.
        preferred_batch_sizes: the size buckets, besides powers of two.
        pin_memory: allocate torch host buffers pinned (only where CUDA is available).
    """

    def __init__(
        self,
        budget_bytes: int,
        preferred_batch_sizes: Sequence[int] = (),
        *,
        pin_memory: bool = False,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError("budget_bytes", budget_bytes, "an integer number of bytes >= 1")
        self.budget_bytes = budget_bytes
        self.preferred = tuple(sorted(set(preferred_batch_sizes)))
        self.pin_memory = pin_memory and _cuda_available()
        self._lock = threading.Lock()
        self._idle: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self._bytes_held = 0
        self._num_buffers = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def bucket(self, rows: int) -> int:
        return bucket_rows(rows, self.preferred)

    def acquire_numpy(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An idle NumPy buffer of ``shape`` and ``dtype``, else a new one."""
        buffer = self._take(("numpy", np.dtype(dtype), shape))
        if buffer is None:
            buffer = _pinned_numpy(shape, dtype) if self.pin_memory else None
            if buffer is None:
                buffer = np.empty(shape, dtype=dtype)
        return buffer  # type: ignore[no-any-return]

    def acquire_torch(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """An idle torch buffer of ``shape`` and ``dtype`` on ``device``, else a new one
        (pinned when the pool pins and the device is the CPU)."""
        buffer = self._take(("torch", str(dtype), shape, str(device)))
        if buffer is None:
            import torch

            pin = self.pin_memory and torch.device(device).type == "cpu"
            buffer = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        return buffer

    def _take(self, full_key: Hashable) -> Any:
        with self._lock:
            idle = self._idle.get(full_key)
            if idle:
                buffer = idle.pop()
                self._idle.move_to_end(full_key)
                self._bytes_held -= _nbytes(buffer)
                self._num_buffers -= 1
                self._hits += 1
                return buffer
            self._misses += 1
            return None

    def release(self, buffer: Any) -> None:
        """Give a leased buffer back; kept unless it alone passes the budget."""
        full_key = _key_of(buffer)
        nbytes = _nbytes(buffer)
        with self._lock:
            if nbytes > self.budget_bytes:
                self._evictions += 1
                return
            while self._bytes_held + nbytes > self.budget_bytes and self._idle:
                _, dropped = self._idle.popitem(last=False)  # least recently used
                for old in dropped:
                    self._bytes_held -= _nbytes(old)
                self._num_buffers -= len(dropped)
                self._evictions += len(dropped)
            self._idle.setdefault(full_key, []).append(buffer)
            self._idle.move_to_end(full_key)
            self._bytes_held += nbytes
            self._num_buffers += 1

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                bytes_held=self._bytes_held,
                budget_bytes=self.budget_bytes,
                num_buffers=self._num_buffers,
            )

    def clear(self) -> None:
        """Drop every idle buffer (not counted as evictions)."""
        with self._lock:
            self._idle.clear()
            self._bytes_held = 0
            self._num_buffers = 0


def _key_of(buffer: Any) -> Hashable:
    """The key a buffer was acquired under, read off the buffer itself."""
    if isinstance(buffer, np.ndarray):
        # The dtype itself: its .str is "|V4" for every structured dtype of four bytes,
        # whatever their fields, and such buffers were handed out for one another.
        return ("numpy", buffer.dtype, buffer.shape)
    return ("torch", str(buffer.dtype), tuple(buffer.shape), str(buffer.device))


def _pinned_numpy(shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    """A NumPy array over pinned torch memory (the runner's ``torch.from_numpy`` then copies
    it to the device asynchronously), or None for a dtype torch has no tensor of."""
    import torch

    try:
        like = torch.from_numpy(np.empty(0, dtype=dtype))
    except TypeError:
        return None
    pinned: np.ndarray = torch.empty(shape, dtype=like.dtype, pin_memory=True).numpy()
    return pinned


_CUDA_LOGGED = False


def _cuda_available() -> bool:
    global _CUDA_LOGGED
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    if not _CUDA_LOGGED:
        _CUDA_LOGGED = True
        log.info("buffer pool: no CUDA device, so host buffers are not pinned")
    return False
