"""A batcher's lifecycle: its states, the event loop it runs on, start, stop and drain.

::

    NEW ──start()──► RUNNING ──stop()──► DRAINING ──every replica loop ended──► STOPPED
                        ▲                                                          │
                        └───────────────────────── start() ────────────────────────┘

``cut_off()`` (or a ``stop(timeout_s=...)`` whose time ran out) goes to DRAINING at once
and fails what is left with :class:`Closed`: the replica loops are cancelled, and a replica
thread still computing is left behind rather than waited for.

A batcher runs on the event loop that started it. When that loop is closed without a
stop (the ``asyncio.run`` that started it returned), the next start, submit or stop
leaves it: back to NEW, with what was queued there forgotten.

:class:`Lifecycle` is the base class of :class:`~carpool.core.batcher.Batcher`, not a
helper it owns: the request path reads ``_state`` and ``_loop`` on every request, and a
hop through another object there would be paid by every request.
"""

from __future__ import annotations

import asyncio
import enum
import math
import threading
from typing import Self

from carpool.core.clock import Clock
from carpool.core.dispatch import Dispatcher
from carpool.core.queues import Queues
from carpool.core.request import Outcome
from carpool.core.telemetry import Telemetry
from carpool.errors import Closed, ConfigError


class State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Lifecycle:
    """Start, stop and drain (see the module docstring). It alone writes ``_state``,
    ``_loop`` and ``_started_s``; the batcher reads them."""

    def __init__(
        self,
        name: str,
        *,
        clock: Clock,
        queues: Queues,
        telemetry: Telemetry,
        dispatch: Dispatcher,
    ) -> None:
        self._name = name
        self._clock = clock
        self._queues = queues
        self._telemetry = telemetry
        self._dispatch = dispatch
        self._state = State.NEW
        self._starting: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None  # stop()'s drain, once begun
        self._loop: asyncio.AbstractEventLoop | None = None  # start() sets it
        self._loop_thread_id = 0  # the thread that ran self._loop when it started
        self._started_s = math.nan

    async def start(self) -> None:
        """Load every replica and start pulling batches. Idempotent.

        Raises:
            RuntimeError: the batcher runs on another event loop that is still open.
        """
        if self._state is State.RUNNING:
            if self._is_on_its_loop():
                return
            self._leave_closed_loop()  # raises if that loop is still open
        if self._starting is not None:
            if not self._is_on_its_loop():
                raise self._on_another_loop()  # its start is that loop's to await
            try:
                return await asyncio.shield(self._starting)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # this caller was cancelled
                return await self.start()  # the caller who was starting it was: try again
        if self._state is State.DRAINING:
            raise Closed(self._name)
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._starting = loop.create_future()
        try:
            await self._dispatch.load()
            self._started_s = self._clock.now()
            self._state = State.RUNNING
            self._dispatch.run(loop)
            self._starting.set_result(None)
        except BaseException as exc:
            self._starting.set_exception(exc)
            self._starting.exception()  # retrieved here; concurrent starters re-raise it
            raise
        finally:
            self._starting = None

    async def stop(self, drain: bool = True, *, timeout_s: float | None = None) -> None:
        """Stop accepting requests. With ``drain`` every queued request is still run and
        answered (without waiting for batches to fill); without it they fail with
        :class:`Closed`. Returns when every replica loop and thread has ended. Cancelling
        it (a ``wait_for`` that timed out) stops the waiting, not the drain: what was
        accepted is still answered, and the batcher stops once it has been.

        ``timeout_s`` bounds the drain: what is still unanswered then is cut off
        (:meth:`cut_off`), and replicas still computing are left behind, not waited for.

        Raises:
            ConfigError: ``timeout_s`` is not a finite number >= 0 or None.
            RuntimeError: the batcher runs on another event loop that is still open.
        """
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float)
            and not isinstance(timeout_s, bool)
            and 0 <= timeout_s < math.inf
        ):
            raise ConfigError("timeout_s", timeout_s, "a finite number of seconds >= 0, or None")
        if self._state in (State.RUNNING, State.DRAINING) and not self._is_on_its_loop():
            # Started on a loop that is gone: nothing there can be drained or answered.
            self._leave_closed_loop()  # raises if that loop is still open
            self._state = State.STOPPED
            return
        if self._starting is not None:
            if not self._is_on_its_loop():
                raise self._on_another_loop()
            # A start in progress would otherwise bring the batcher up after this returns.
            await asyncio.wait({self._starting})
        if self._state in (State.NEW, State.STOPPED):
            return
        self._state = State.DRAINING
        if not drain:
            for queue in self._queues.ordered:
                for request in list(queue.live()):
                    self._dispatch.drop(request, Outcome.CLOSED)
        self._dispatch.drain()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        closing = self._closing
        timer = None
        if timeout_s is not None:
            timer = self._clock.call_at(self._clock.now() + timeout_s, self._time_is_up)
        try:
            await asyncio.shield(closing)
        finally:
            if timer is not None:
                timer.cancel()

    def _time_is_up(self) -> None:
        self.cut_off()

    def cut_off(self) -> int:
        """Stop at once, without waiting for what is left: every queued or running
        request fails with :class:`Closed`, replicas still computing are given up (a
        thread that never returns is left behind, as after a hang), and the batcher
        stops. Returns how many requests were cut off; 0 when it was not running."""
        if self._state not in (State.RUNNING, State.DRAINING) or not self._is_on_its_loop():
            return 0
        self._state = State.DRAINING
        num_cut_off = self._dispatch.cut_off()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return num_cut_off

    async def _close(self) -> None:
        """Wait for every replica loop to end, then close the replicas: STOPPED."""
        try:
            await self._dispatch.join()
        finally:
            self._closing = None
            self._state = State.STOPPED

    def _is_on_its_loop(self) -> bool:
        """Whether the caller runs on the loop this batcher started on (cheaper than
        asyncio.get_running_loop(), which makes a getpid() syscall): a loop in another
        thread, or another loop of this thread after the first stopped running, is not."""
        loop = self._loop
        return (
            loop is not None and self._loop_thread_id == threading.get_ident() and loop.is_running()
        )

    def _leave_closed_loop(self) -> None:
        """Back to NEW after the loop this batcher ran on was closed without a stop:
        replica threads closed, and requests queued there forgotten (their callers' loop
        is gone; nothing can answer them). Its replica tasks may have ended anywhere
        (asyncio.run cancels them; a bare loop.close() does not): their idle waiters and
        the batches they held count for nothing now.

        Raises:
            RuntimeError: that loop is still open (running in another thread, or idle):
                its futures cannot be awaited from this one, nor its tasks stopped.
        """
        if self._loop is not None and not self._loop.is_closed():
            raise self._on_another_loop()
        self._closing = None
        self._queues.replicas_gone()
        now = self._clock.now()
        for queue in self._queues.ordered:
            for request in list(queue.live()):
                request.timer = None
                self._queues.forget(request)
                self._telemetry.answered(request, Outcome.CLOSED, now)
        self._dispatch.abandon()
        self._state = State.NEW

    def _on_another_loop(self) -> RuntimeError:
        return RuntimeError(
            f"batcher {self._name!r} runs on another event loop, which is still open; "
            "call it from that loop, stop it there first, or make one batcher per loop"
        )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(drain=True)
