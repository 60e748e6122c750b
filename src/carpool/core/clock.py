"""Time as a pluggable part, so that tests drive it instead of waiting on it.

The batcher reads the time with :meth:`Clock.now` and asks to be woken with
:meth:`Clock.call_at`. :class:`MonotonicClock` is the real one (the event loop's
timers over ``time.monotonic``); :class:`FakeClock` moves only when a test calls
:meth:`FakeClock.advance`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Reads monotonic seconds and schedules callbacks on the running event loop."""

    def now(self) -> float: ...

    def call_at(self, when_s: float, callback: Callable[[], None]) -> TimerHandle: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and the event loop's timers."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when_s: float, callback: Callable[[], None]) -> TimerHandle:
        """``callback`` at ``when_s`` or later, never before: uvloop rounds a timer's delay
        to the nearest millisecond, so its timers may fire half a millisecond early (a
        deadline would refuse a request still in time); one that does is armed again."""
        return _LoopTimer(asyncio.get_running_loop(), when_s, callback)


class _LoopTimer:
    """A MonotonicClock timer: the loop's handle of its latest arming.

    It lets go of its callback (and of what the callback holds: a request, its future)
    when it fires or is cancelled. A closure that re-arms itself would be a reference
    cycle, and every request with a deadline would then leave its objects to the cyclic
    garbage collector, whose pauses grow with the traffic (docs/reliability.md).
    """

    __slots__ = ("_callback", "_loop", "_when_s", "handle")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, when_s: float, callback: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._when_s = when_s
        self._callback: Callable[[], None] | None = callback
        # loop.time() is time.monotonic() for the standard and uvloop loops; converting
        # through a delay keeps this correct for any loop whose epoch differs.
        self.handle: asyncio.TimerHandle | None = loop.call_later(
            max(0.0, when_s - time.monotonic()), self._fire
        )

    def _fire(self) -> None:
        remaining_s = self._when_s - time.monotonic()
        if remaining_s > 0:
            self.handle = self._loop.call_later(remaining_s, self._fire)
            return
        callback, self._callback, self.handle = self._callback, None, None
        if callback is not None:
            callback()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self._callback = self.handle = None


class _FakeTimer:
    """A FakeClock timer; ``clock`` is None once it fired (cancelling it then counts for
    nothing)."""

    __slots__ = ("callback", "clock", "is_cancelled")

    def __init__(self, callback: Callable[[], None], clock: FakeClock) -> None:
        self.callback: Callable[[], None] | None = callback
        self.clock: FakeClock | None = clock
        self.is_cancelled = False

    def cancel(self) -> None:
        if self.is_cancelled:
            return
        self.is_cancelled = True
        self.callback = None  # what it holds goes now, not when its time comes
        if self.clock is not None:
            self.clock._note_cancelled()


# A FakeClock rebuilds its heap without cancelled timers once they are more than half of
# it (and more than this): a timer cancelled long before its time (a batch_timeout_s
# watchdog, one per batch) would otherwise stay in the heap for the rest of the test.
COMPACT_AFTER_CANCELLED = 64


class FakeClock:
    """A clock that moves only when told to; timers fire in time order on ``advance``."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now_s = start_s
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()
        self._num_cancelled = 0  # cancelled timers still in the heap

    def now(self) -> float:
        return self._now_s

    def call_at(self, when_s: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer(callback, self)
        heapq.heappush(self._timers, (when_s, next(self._seq), timer))
        return timer

    def _note_cancelled(self) -> None:
        self._num_cancelled += 1
        num = self._num_cancelled
        if num > COMPACT_AFTER_CANCELLED and 2 * num > len(self._timers):
            self._timers = [entry for entry in self._timers if not entry[2].is_cancelled]
            heapq.heapify(self._timers)
            self._num_cancelled = 0

    @property
    def num_pending_timers(self) -> int:
        return sum(1 for _, _, t in self._timers if not t.is_cancelled)

    def next_timer_s(self) -> float | None:
        """When the earliest live timer fires, or ``None``."""
        while self._timers and self._timers[0][2].is_cancelled:
            heapq.heappop(self._timers)
            self._num_cancelled -= 1
        return self._timers[0][0] if self._timers else None

    async def advance(self, delta_s: float) -> None:
        """Move time forward by ``delta_s``, firing due timers and letting the loop settle."""
        target = self._now_s + delta_s
        await settle()
        while (when := self.next_timer_s()) is not None and when <= target:
            _, _, timer = heapq.heappop(self._timers)
            self._now_s = max(self._now_s, when)
            callback, timer.callback, timer.clock = timer.callback, None, None
            assert callback is not None, "next_timer_s() leaves a live timer in front"
            callback()
            await settle()
        self._now_s = target
        await settle()


async def settle(rounds: int = 20) -> None:
    """Let every ready task on the loop run until the loop goes quiet (no wall time)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
