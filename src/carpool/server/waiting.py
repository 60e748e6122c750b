"""Where an HTTP connection waits after a refusal, until its model's queues have room.

A client refused with a 429 may send its next request at once (a closed loop that
retries, a load balancer's health of its own). Read and refused again at once, a storm
of retries takes the CPU the model needs: under 1,000 such connections, refusals cut the
successful answers to 0.6 of capacity. So a connection that got a 429 from its head
stops being read: its next request waits in the kernel's socket buffer, which costs the
server nothing, until the model can admit requests again; then as many waiting
connections as there is room for are read again, the longest waiting first. While
connections wait, each holds a place in the queue: a request on another connection is
refused (and its connection waits) rather than take the room they wait for, so no
connection waits long. The refusal itself still goes out at once, and a connection
waits at most :data:`MAX_WAIT_S` (the ``Retry-After`` it was given): whatever it sends
meanwhile, a request to another model or a health probe included, is read by then.

A connection let in goes on holding its place until its next request is read (a loop turn
or more later), for at most :data:`PROMISE_S`: until then the room it was given is
promised. Released as the connection was let in, the place went to a request read first
on another connection, and the next check let in more connections than there was room
for; each of those was refused again once read, its wait in the room counted in that
refusal's time (a third of the refusals slower than 10 ms in a loaded soak).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from carpool.core.front import BatchFront

CHECK_S = 0.001  # how often the room is looked at while connections wait
MAX_WAIT_S = 1.0  # the Retry-After of the 429 that sent the connection here
PROMISE_S = 0.1  # how long a connection let in holds its place for its next request


class WaitingRoom:
    """Connections waiting, per model, for room in its queues."""

    __slots__ = ("_promised", "_timer", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[BatchFront, deque[tuple[float, Callable[[bool], bool]]]] = {}
        # Per model, when each place promised to a connection let in lapses, oldest first.
        self._promised: dict[BatchFront, deque[float]] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def num_waiting_for(self, batcher: BatchFront) -> int:
        """Connections waiting for ``batcher``, or let in and not yet read: each holds a
        place in its queues, so a request on another connection does not take the room
        they wait for."""
        return len(self._waiting.get(batcher, ())) + len(self._promised.get(batcher, ()))

    def take_place(self, batcher: BatchFront) -> None:
        """A connection let in has its next request read: the place it held is its own."""
        promised = self._promised.get(batcher)
        if promised:
            promised.popleft()

    def wait(self, batcher: BatchFront, resume: Callable[[bool], bool]) -> None:
        """``resume(True)`` once ``batcher`` has room, in turn, or ``resume(False)`` after
        :data:`MAX_WAIT_S` without; it returns False when its connection is gone, which
        takes no room."""
        loop = asyncio.get_running_loop()
        self._waiting.setdefault(batcher, deque()).append((loop.time(), resume))
        if self._timer is None:
            self._timer = loop.call_later(CHECK_S, self._check)

    def _check(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for batcher, promised in list(self._promised.items()):
            while promised and promised[0] <= now:
                promised.popleft()  # its connection sent nothing for this model
            if not promised:
                del self._promised[batcher]
        too_long = now - MAX_WAIT_S
        for batcher, waiting in list(self._waiting.items()):
            if batcher.is_running:
                room = batcher.num_free - len(self._promised.get(batcher, ()))
            else:
                room = len(waiting)
            while waiting and room > 0:
                if waiting.popleft()[1](True):
                    room -= 1
                    self._promised.setdefault(batcher, deque()).append(now + PROMISE_S)
            while waiting and waiting[0][0] <= too_long:
                waiting.popleft()[1](False)
            if not waiting:
                del self._waiting[batcher]
        if self._waiting or self._promised:
            self._timer = loop.call_later(CHECK_S, self._check)
