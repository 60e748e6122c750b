"""Giving up on a model call that hangs: the thread it holds, and the watch that decides.

A Python thread cannot be stopped from outside: a model call that never returns holds its
replica's thread for ever, and every call queued on that thread waits behind it. So a
threaded replica runs its calls on a :class:`ReplicaThread`, which can be *abandoned*:
the calls queued on it fail at once (they never started and may run elsewhere), the one
running is left to return whenever it does (its result is dropped: its requests were
answered already), and the replica goes on with a fresh thread. The thread is a daemon,
so one that never returns does not hold the process's exit as a ``ThreadPoolExecutor``'s
worker would (its threads are joined at exit).

A :class:`CallWatch` follows one model call: the replica thread writes when the call
started. While the event loop waits for it, the replica's :class:`ThreadWatch` holds it,
and its timer (on the batcher's clock) declares the call hung once ``batch_timeout_s``
has passed since it started, unless it ended first::

    loop:    submit ── wait (watch) ─────────────── timer: started + timeout passed? ─► hung
    thread:  [ earlier call ][ this call ..................................... (stuck)
                             ^ started_s
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from typing import Any

from carpool.core.clock import Clock, TimerHandle
from carpool.errors import Displaced, Hung

log = logging.getLogger("carpool.replicas")


class Watchdog:
    """A batcher's ``batch_timeout_s`` (None: no limit) and the clock its timers use; its
    replicas share it, and a policy change takes effect for calls started after it."""

    __slots__ = ("clock", "timeout_s")

    def __init__(self, clock: Clock, timeout_s: float | None) -> None:
        self.clock = clock
        self.timeout_s = timeout_s


class CallWatch:
    """One model call queued on ``thread`` with a limit of ``timeout_s``: ``started_s`` is
    written by the thread when the call starts (NaN until then); ``running`` is the
    future the loop awaits for it."""

    __slots__ = ("running", "started_s", "thread", "timeout_s")

    def __init__(self, thread: ReplicaThread, timeout_s: float) -> None:
        self.thread = thread
        self.timeout_s = timeout_s
        self.started_s = math.nan
        self.running: asyncio.Future[Any] | None = None

    def due_s(self, now: float) -> float:
        """When the call will have run ``timeout_s``; from ``now`` if it has not started
        (it still waits behind an earlier call of its thread, as a build)."""
        started = self.started_s
        return (now if math.isnan(started) else started) + self.timeout_s

    def verdict(self, now: float, replica_id: int) -> Exception:
        """What the call raises once its thread was given up."""
        if math.isnan(self.started_s):
            return Displaced(now)
        return Hung(self.started_s, self.timeout_s, replica_id)


class ThreadWatch:
    """Watches the call a replica's loop waits for (``watch``, then ``unwatch`` once it
    landed) and calls ``on_hung`` with it once it has run its ``timeout_s``.

    Calls on a replica's thread run one after the other, so one timer serves them all:
    when it fires it looks at the call watched then, and is armed again for that call's
    due time (or left unarmed when none is watched). A batch pays two attribute writes
    and a clock read, not a timer armed and cancelled."""

    __slots__ = ("_clock", "_due_s", "_on_hung", "_timer", "current")

    def __init__(self, clock: Clock, on_hung: Callable[[CallWatch], None]) -> None:
        self._clock = clock
        self._on_hung = on_hung
        self._timer: TimerHandle | None = None
        self._due_s = math.inf
        self.current: CallWatch | None = None

    def watch(self, call: CallWatch) -> None:
        self.current = call
        due_s = call.due_s(self._clock.now())
        if due_s < self._due_s:  # none armed, or for later (a longer limit before)
            if self._timer is not None:
                self._timer.cancel()
            self._arm(due_s)

    def unwatch(self, call: CallWatch) -> None:
        if self.current is call:
            self.current = None

    def close(self) -> None:
        """Watch nothing more: the timer is cancelled, so the loop lets go of the replica
        (and of its model) now, not when the timer would have fired, ``timeout_s`` after
        its last arming (``carpool tune`` rebuilds a batcher per trial: every model built
        stayed in memory for the watchdog's minute)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._due_s, self.current = None, math.inf, None

    def _arm(self, due_s: float) -> None:
        self._due_s = due_s
        self._timer = self._clock.call_at(due_s, self._fire)

    def _fire(self) -> None:
        self._timer, self._due_s = None, math.inf
        call = self.current
        if call is None:
            return
        now = self._clock.now()
        due_s = call.due_s(now)
        if due_s > now:
            self._arm(due_s)
        else:
            self.current = None
            self._on_hung(call)


class _Job:
    __slots__ = ("args", "fn", "future")

    def __init__(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.future = future
        self.fn = fn
        self.args = args


class ReplicaThread(Executor):
    """One daemon thread that runs the calls submitted to it in order (an executor for
    ``loop.run_in_executor``), and that can be abandoned (see the module docstring).
    ``initializer`` runs first on the thread."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self.name = name
        self.is_abandoned = False
        self._initializer = initializer
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._is_shut_down = False
        self._is_running_job = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if kwargs:
            raise TypeError("ReplicaThread.submit takes positional arguments only")
        future: Future[Any] = Future()
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError(f"thread {self.name} is shut down: it takes no more calls")
            self._jobs.put(_Job(future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return future

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:
                log.exception("the initializer of thread %s raised; its calls still run", self.name)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            self._is_running_job = True
            try:
                result = job.fn(*job.args)
            except BaseException as exc:  # as ThreadPoolExecutor: the caller gets it
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            finally:
                self._is_running_job = False
            del job  # what the call held is not kept while the thread waits for the next

    @property
    def is_busy(self) -> bool:
        """Whether a call runs or waits on this thread (read without a lock: a call that
        ends at the moment it is read may count as running)."""
        return self._is_running_job or not self._jobs.empty()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._is_shut_down:
                self._is_shut_down = True
                if cancel_futures:
                    self._cancel_queued()
                self._jobs.put(None)
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def abandon(self) -> None:
        """Give up on this thread: the calls queued on it are cancelled, it takes no more,
        and it ends once its running call returns, if ever."""
        self.is_abandoned = True
        self.shutdown(wait=False, cancel_futures=True)

    def _cancel_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.future.cancel()


def is_cancelling() -> bool:
    """Whether the running task is being cancelled (the replica stops), rather than a
    future it awaits."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def awaited_within(
    awaitable: Awaitable[Any], clock: Clock, started_s: float, timeout_s: float, replica_id: int
) -> Any:
    """``await awaitable``, cancelled once ``timeout_s`` has passed since ``started_s`` on
    ``clock`` (as ``asyncio.timeout`` does on the loop's clock), then raising
    :class:`Hung`."""
    task = asyncio.current_task()
    assert task is not None
    is_expired = False

    def expire() -> None:
        nonlocal is_expired
        is_expired = True
        task.cancel()

    timer = clock.call_at(started_s + timeout_s, expire)
    try:
        result = await awaitable
    except asyncio.CancelledError:
        if is_expired and task.uncancel() == 0:  # only this cancel: not a stop as well
            raise Hung(started_s, timeout_s, replica_id) from None
        raise
    finally:
        timer.cancel()
    if is_expired:  # the model caught the cancellation and returned: its answer stands
        task.uncancel()
    return result
