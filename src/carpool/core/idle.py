"""Idle replica loops, the least busy lately first (see ``carpool.core.dispatch``).

:class:`BusyTime` is a replica's time computing, decayed over ``BUSY_DECAY_S``, kept as a
key that orders replicas without being updated while they idle; :class:`IdleReplicas`
holds the waiters of idle replica loops and gives the one with the lowest key first.
"""

from __future__ import annotations

import asyncio
import heapq
import math

# The time constant over which a replica's time computing is remembered when choosing
# which idle replica takes a batch: a few dozen batches of a typical model.
BUSY_DECAY_S = 1.0


def wake(waiter: asyncio.Future[None]) -> None:
    """Wake a loop waiting on ``waiter``, unless it was woken or cancelled already."""
    if not waiter.done():
        waiter.set_result(None)


class IdleReplicas(set[asyncio.Future[None]]):
    """The waiters of idle replica loops: a set of those still waiting, and a heap that
    gives the least busy lately first.

    Each waiter is pushed with its replica's :attr:`BusyTime.key`, which orders replicas by
    their decayed time computing at any one moment, so :meth:`take` is O(log n). Being
    the set itself, its truth and length are the set's, at C speed: the request path asks
    whether a replica is idle on every request. A waiter taken out otherwise (its own
    timer woke it, or it was cancelled) stays in the heap, skipped when met, until such
    waiters are more than half of it.
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0  # among equal keys, the first pushed comes out first

    def push(self, waiter: asyncio.Future[None], key: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (key, self._seq, waiter))
        self.add(waiter)

    def take(self) -> asyncio.Future[None] | None:
        """The waiter with the lowest key, taken out; None when there is none."""
        heap = self._heap
        while heap:
            waiter = heapq.heappop(heap)[2]
            if waiter in self:
                self.remove(waiter)
                return waiter
        return None

    def drop(self, waiter: asyncio.Future[None]) -> None:
        """Take out ``waiter`` if it is still here (its heap entry is left behind)."""
        if waiter in self:
            self.remove(waiter)
            if len(self._heap) > 2 * len(self) + 16:
                self._heap = [entry for entry in self._heap if entry[2] in self]
                heapq.heapify(self._heap)

    def clear(self) -> None:
        super().clear()
        self._heap.clear()


class BusyTime:
    """A replica's time computing, decayed with time constant ``BUSY_DECAY_S``.

    Replicas that have all been up since about the same time have seen the same decayed
    total time, so the lowest decayed busy time is the lowest recent busy fraction.
    Between batches it only decays, at the same rate for every replica, so
    ``log(busy_s) + at_s / BUSY_DECAY_S`` orders replicas as their busy times do at any
    later moment: a key that needs no update while the replica is idle.
    """

    __slots__ = ("at_s", "busy_s", "key")

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.at_s = 0.0
        self.key = -math.inf  # never busy: chosen first

    def add(self, end_s: float, compute_s: float) -> None:
        """A batch that computed ``compute_s`` landed at ``end_s``."""
        if self.busy_s > 0.0:
            self.busy_s *= math.exp(min(0.0, self.at_s - end_s) / BUSY_DECAY_S)
        self.busy_s += compute_s
        self.at_s = end_s
        if self.busy_s > 0.0:
            self.key = math.log(self.busy_s) + end_s / BUSY_DECAY_S
