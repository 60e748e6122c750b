"""Memory given back to the system once a burst of requests is over.

A burst (thousands of pipelined 64 KiB bodies, a long queue of decoded tensors) is freed
by Python when it ends, but the C allocator keeps the freed pages for reuse: the
process's RSS stays at the burst's peak for good, and an operator cannot tell a burst
from a leak. glibc's ``malloc_trim(0)`` hands every free page of every arena back. The
server calls it once when it falls quiet after at least ``MIN_REQUESTS`` requests (no
request answered for a second, nothing queued, no body held), never under steady load,
on a worker thread (ctypes lets go of the GIL).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("carpool.server")

MIN_REQUESTS = 1000  # a burst worth trimming after: fewer never grew the heap much
TICK_S = 1.0


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None (with one INFO line) where the C library has
    none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        log.info(
            "malloc_trim is not available in this C library: memory freed after a burst "
            "of requests stays with the process (reused by the next one)"
        )
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Trimmer:
    """Decides, once per :data:`TICK_S`, whether the server just fell quiet after a
    burst: then ``trim`` runs, once, until :data:`MIN_REQUESTS` more are answered."""

    __slots__ = ("_is_idle", "_last", "_num_requests", "_since_trim", "trim")

    def __init__(
        self,
        num_requests: Callable[[], int],
        is_idle: Callable[[], bool],
        trim: Callable[[], object],
    ) -> None:
        self._num_requests = num_requests
        self._is_idle = is_idle
        self.trim = trim
        self._last = num_requests()
        self._since_trim = 0

    def tick(self) -> bool:
        """True when it is time to trim (the caller runs ``trim``)."""
        count = self._num_requests()
        answered, self._last = count - self._last, count
        self._since_trim += answered
        if answered or self._since_trim < MIN_REQUESTS or not self._is_idle():
            return False
        self._since_trim = 0
        return True
