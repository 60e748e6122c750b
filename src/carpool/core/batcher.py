"""The public async face of the batching engine: submit, start, stop.

Each replica runs one loop: ask the scheduler for a batch; if there is one, run it;
if not, sleep until a request arrives or the oldest request's delay expires. A batch is
therefore closed only when a replica is free to run it, and while every replica is busy
requests pile up, so batches grow with load (pull-based, least-loaded by construction).

A batch that raises is bisected until the failing requests are found; only they get a
:class:`ModelError`. Out of memory splits the batch into halves, retries them, and lowers
the effective max batch size until ``oom_recovery_s`` passes without another.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from carpool.core.admission import Intake, OomCap, deadline, inspect_payload, request_cost
from carpool.core.clock import Clock, MonotonicClock
from carpool.core.collate import Collator
from carpool.core.policy import BatchPolicy
from carpool.core.queues import Queues
from carpool.core.replicas import (
    BatchFn,
    FnFactory,
    Replica,
    RunOutput,
    check_threading,
    io_turn,
    replica_devices,
    switch_interval,
)
from carpool.core.request import Batch, Outcome, Request, RequestState
from carpool.core.scheduler import Decision, Scheduler
from carpool.core.settle import Settler, by_signature
from carpool.core.telemetry import (
    NullTelemetry,
    Telemetry,
    TelemetrySnapshot,
    TraceHook,
    guarded_hook,
)
from carpool.errors import (
    CarpoolError,
    Closed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
)

MemoryProbe = Callable[[], tuple[int, int]]  # (used_bytes, total_bytes)

log = logging.getLogger("carpool")

_QUEUED = RequestState.QUEUED


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Batcher:
    """Coalesces single requests into batches for one model.

    Args:
        fn: the batched model: takes one batch, returns outputs aligned with it along
            axis 0. Sync functions run on a replica thread, ``async`` ones on the loop.
        policy: batching limits; :class:`BatchPolicy` defaults when omitted.
        name: the model's name in telemetry and thread names.
        num_replicas: copies of the model pulling batches concurrently.
        devices: one device string per replica (sets ``num_replicas``).
        fn_factory: instead of ``fn``: called once per replica with its device string,
            on that replica's thread, returning the replica's model.
        collate: "auto" (by the first payload's type), "list", "numpy", "torch" or a
            :class:`~carpool.core.collate.Collator`.
        clock: time source; tests pass a :class:`~carpool.core.clock.FakeClock`.
        on_trace: called with each finished request's :class:`RequestTrace`.
        slow_request_s: log, to ``carpool.slow``, where the time of slower requests went.
        memory_probe: returns ``(used_bytes, total_bytes)`` after each batch.
        telemetry: False only to measure what telemetry costs (benchmarks).
        switch_interval_s: while a batcher with a sync model runs, the interpreter's GIL
            switch interval is lowered to this (restored when the last such batcher
            stops), so the model thread is not held off the GIL by the event loop's
            bursts; ``None`` leaves the interpreter alone.
        executor: where a sync model runs: ``"thread"``, each replica on its own thread;
            ``"loop"``, on the event loop's thread (the loop waits for each batch);
            ``"auto"`` (default), on the loop for a CPU model when the process may use only
            one CPU, where a thread would only take turns with the loop on that core.
        policy_check: called with the policy at construction and with every new one
            (``set_policy``/``update_policy``); raises ConfigError for a policy the model
            cannot serve (a token budget smaller than one item the model may take).

    Raises:
        ConfigError: naming an argument of the wrong kind (a policy that is not a
            BatchPolicy, a hook that is not callable, devices not a list of strings), or
            arguments that contradict each other.
    """

    def __init__(
        self,
        fn: BatchFn | None = None,
        policy: BatchPolicy | None = None,
        *,
        name: str | None = None,
        num_replicas: int | None = None,
        devices: list[str] | None = None,
        fn_factory: FnFactory | None = None,
        collate: str | Collator = "auto",
        clock: Clock | None = None,
        on_trace: TraceHook | None = None,
        slow_request_s: float | None = None,
        memory_probe: MemoryProbe | None = None,
        telemetry: bool = True,
        switch_interval_s: float | None = 0.0005,
        executor: str = "auto",
        policy_check: Callable[[BatchPolicy], None] | None = None,
    ) -> None:
        if (fn is None) == (fn_factory is None):
            raise ConfigError("fn", fn, "exactly one of fn or fn_factory")
        _check_options(
            policy,
            name,
            clock,
            slow_request_s,
            fn,
            fn_factory,
            on_trace,
            memory_probe,
            policy_check,
        )
        self._policy_check = policy_check
        self._fn = fn
        self._fn_factory = fn_factory
        self._name = name or getattr(fn or fn_factory, "__name__", None) or "model"
        self._devices = replica_devices(num_replicas, devices)
        self._policy = policy if policy is not None else BatchPolicy()
        if policy_check is not None:
            policy_check(self._policy)
        self._intake = Intake(collate)
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._memory_probe = memory_probe
        check_threading(switch_interval_s, executor)
        self._switch_interval_s = switch_interval_s
        self._holds_switch_interval = False
        self._executor = executor
        slos = {c.name: c.slo_s for c in self._policy.classes}
        telemetry_cls = Telemetry if telemetry else NullTelemetry
        self._telemetry = telemetry_cls(
            self._name,
            slos,
            on_trace=None if on_trace is None else guarded_hook(on_trace, self._name),
            slow_request_s=slow_request_s,
        )
        self._queues = Queues(self._policy)
        self._scheduler = Scheduler()
        if self._intake.collator is not None:
            self._adopt(self._intake.collator)
        else:
            self._intake.check(self._policy)
        self._state = _State.NEW
        self._starting: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None  # stop()'s drain, once begun
        self._loop: asyncio.AbstractEventLoop | None = None  # start() sets it
        self._loop_thread_id = 0  # the thread that ran self._loop when it started
        self._replicas: list[Replica] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._idle: deque[asyncio.Future[None]] = deque()
        self._request_ids = itertools.count()
        # Each launched batch's note of cancellations, by batch id, until it lands.
        self._cancels: dict[int, _Cancels] = {}
        self._started_s = math.nan
        self._oom = OomCap()
        self._settler = Settler(self._telemetry, self._clock, self._oom)

    # -- properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    @property
    def is_running(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def num_replicas(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> tuple[str, ...]:
        """Each replica's device string, in replica order."""
        return tuple(self._devices)

    @property
    def num_pending(self) -> int:
        return self._queues.num_live

    @property
    def effective_max_batch_size(self) -> int:
        """``max_batch_size``, or less while recovering from out of memory."""
        max_size = self._policy.max_batch_size
        cap = self._oom.current(self._clock.now(), self._policy)
        return max_size if cap is None else min(cap, max_size)  # max may be lowered since

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Load every replica and start pulling batches. Idempotent.

        Raises:
            RuntimeError: the batcher runs on another event loop that is still open.
        """
        if self._state is _State.RUNNING:
            if self._is_on_its_loop():
                return
            self._leave_closed_loop()  # raises if that loop is still open
        if self._starting is not None:
            try:
                return await asyncio.shield(self._starting)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # this caller was cancelled
                return await self.start()  # the caller who was starting it was: try again
        if self._state is _State.DRAINING:
            raise Closed(self._name)
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._starting = loop.create_future()
        try:
            replicas = [
                Replica(
                    i,
                    device,
                    self._name,
                    self._fn,
                    self._fn_factory,
                    self._clock.now,
                    self._executor,
                )
                for i, device in enumerate(self._devices)
            ]
            try:
                await asyncio.gather(*(r.load() for r in replicas))
            except BaseException:
                for replica in replicas:
                    replica.close()
                raise
            self._replicas = replicas
            if self._switch_interval_s is not None and any(r.is_threaded for r in replicas):
                switch_interval.hold(self._switch_interval_s)
                self._holds_switch_interval = True
            self._started_s = self._clock.now()
            self._state = _State.RUNNING
            self._tasks = [
                loop.create_task(self._replica_loop(r), name=f"carpool-{self._name}-r{i}")
                for i, r in enumerate(replicas)
            ]
            self._starting.set_result(None)
        except BaseException as exc:
            self._starting.set_exception(exc)
            self._starting.exception()  # retrieved here; concurrent starters re-raise it
            raise
        finally:
            self._starting = None

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting requests. With ``drain`` every queued request is still run and
        answered (without waiting for batches to fill); without it they fail with
        :class:`Closed`. Returns when every replica loop and thread has ended. Cancelling
        it (a ``wait_for`` that timed out) stops the waiting, not the drain: what was
        accepted is still answered, and the batcher stops once it has been.

        Raises:
            RuntimeError: the batcher runs on another event loop that is still open.
        """
        if self._state in (_State.RUNNING, _State.DRAINING) and not self._is_on_its_loop():
            # Started on a loop that is gone: nothing there can be drained or answered.
            self._leave_closed_loop()  # raises if that loop is still open
            self._state = _State.STOPPED
            return
        if self._starting is not None:
            # A start in progress would otherwise bring the batcher up after this returns.
            await asyncio.wait({self._starting})
        if self._state in (_State.NEW, _State.STOPPED):
            return
        self._state = _State.DRAINING
        if not drain:
            for queue in self._queues.ordered:
                for request in list(queue.live()):
                    self._drop(request, Outcome.CLOSED)
        self._wake_all()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        """Wait for every replica loop to end, then close the replicas: STOPPED."""
        try:
            await asyncio.gather(*self._tasks)
        finally:
            self._closing = None
            for replica in self._replicas:
                replica.close()
            if self._holds_switch_interval:
                switch_interval.release()
                self._holds_switch_interval = False
            self._tasks = []
            self._state = _State.STOPPED

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
            raise RuntimeError(
                f"batcher {self._name!r} runs on another event loop, which is still open; "
                "call it from that loop, stop it there first, or make one batcher per loop"
            )
        self._idle.clear()
        self._closing = None
        self._cancels.clear()
        self._queues.replicas_gone()
        now = self._clock.now()
        for queue in self._queues.ordered:
            for request in list(queue.live()):
                request.timer = None
                self._queues.forget(request)
                self._telemetry.answered(request, Outcome.CLOSED, now)
        for replica in self._replicas:
            replica.close()
        if self._holds_switch_interval:
            switch_interval.release()
            self._holds_switch_interval = False
        self._replicas, self._tasks = [], []
        self._state = _State.NEW

    async def __aenter__(self) -> Batcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(drain=True)

    # -- submitting -------------------------------------------------------------------

    async def submit(
        self,
        payload: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Run one item in some batch and return its own output.

        Args:
            payload: one item (the batch stacks items along a new axis 0).
            priority: a class name of the policy; the default class when omitted.
            timeout_s: deadline from now; the class's ``timeout_s`` when omitted.
            cost: this request's cost; ``cost_fn(payload)`` or its item count when omitted.

        Raises:
            InvalidInput, QueueFull, DeadlineExceeded, ModelError, CapacityError, Closed.
        """
        return await self._submit(payload, False, priority, timeout_s, cost)

    async def submit_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
    ) -> Any:
        """Run k items (along axis 0 of ``payloads``) in one batch; returns k outputs."""
        return await self._submit(payloads, True, priority, timeout_s, cost)

    def enqueue_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
    ) -> Request:
        """Queue k items (along axis 0 of ``payloads``) without awaiting them.

        For callers on the loop that cannot afford a task per request (the server's HTTP
        fast path): the returned request's ``future`` resolves to the k outputs, or to the
        error :meth:`submit_many` would raise; :meth:`cancel` withdraws it.

        Raises:
            Closed: the batcher is not running. And what :meth:`submit_many` raises
            before queueing: InvalidInput, QueueFull.
        """
        if self._state is not _State.RUNNING:
            raise Closed(self._name)
        return self._make_request(payloads, True, priority, timeout_s, cost)

    def cancel(self, request: Request) -> None:
        """Withdraw a request from :meth:`enqueue_many`: dropped unanswered if still
        queued (the model never sees it), also if its batch still waits for the replica
        (behind the batch the replica computes); its result ignored if already running."""
        request.future.cancel()
        self._withdraw(request)

    def _withdraw(self, request: Request) -> None:
        """Take out a request whose future its caller cancelled."""
        if request.state is _QUEUED:
            self._drop(request, Outcome.CANCELLED)
        elif request.state is RequestState.RUNNING:
            # Launched: its model call is asked, when its turn comes, whether to run.
            cancels = self._cancels.get(request.batch_id)
            if cancels is not None:
                cancels.seen = True

    async def _submit(
        self,
        payload: Any,
        is_many: bool,
        priority: str | None,
        timeout_s: float | None,
        cost: float | None,
    ) -> Any:
        if self._state is not _State.RUNNING:
            if self._state is not _State.NEW:
                raise Closed(self._name)
            await self.start()
        elif not self._is_on_its_loop():
            # Started by an earlier asyncio.run(): its replica tasks ended with its loop.
            self._leave_closed_loop()  # raises if that loop is still open
            await self.start()
        request = self._make_request(payload, is_many, priority, timeout_s, cost)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._withdraw(request)
            raise

    def _make_request(
        self,
        payload: Any,
        is_many: bool,
        priority: str | None,
        timeout_s: float | None,
        cost: float | None,
    ) -> Request:
        policy = self._policy
        if priority is None:
            limits = policy.limits.get(policy.default_class)
        else:
            limits = policy.limits.get(priority) if isinstance(priority, str) else None
        if limits is None:
            self._telemetry.rejected(policy.default_class, "invalid")
            raise InvalidInput(
                f"unknown priority {priority!r}: expected one of {list(policy.limits)}"
            )
        loop = self._loop  # not asyncio.get_running_loop(): that makes a getpid() syscall
        assert loop is not None, "requests are made only after start()"
        intake = self._intake
        collator = intake.collator
        if collator is None:
            collator = self._adopt(intake.choose(payload))
        now = self._clock.now()
        try:
            num_items, signature = inspect_payload(collator, payload, is_many)
            cost = request_cost(policy, limits, payload, num_items, cost)
            lengths = intake.lengths(payload, is_many, policy) if intake.has_lengths else None
            deadline_s = deadline(now, timeout_s, limits)
        except InvalidInput:
            self._telemetry.rejected(limits.name, "invalid")
            raise
        request = Request(
            request_id=next(self._request_ids),
            payload=payload,
            num_items=num_items,
            is_many=is_many,
            cost=cost,
            class_name=limits.name,
            rank=limits.rank,
            arrival_s=now,
            deadline_s=deadline_s,
            future=loop.create_future(),
            signature=signature,
        )
        if lengths is not None:
            request.num_tokens, request.length, request.bucket = lengths
        try:
            self._queues.admit(request)
        except QueueFull:
            self._telemetry.rejected(limits.name, "queue_full")
            raise
        self._telemetry.admitted(request)
        if deadline_s is not None:
            request.timer = self._clock.call_at(deadline_s, lambda: self._on_deadline(request))
        if self._idle:
            self._wake_one()
        return request

    def _adopt(self, collator: Collator) -> Collator:
        self._intake.adopt(collator, self._policy)
        self._scheduler.padded_cost = self._intake.pads
        return collator

    # -- replica loop -----------------------------------------------------------------

    async def _replica_loop(self, replica: Replica) -> None:
        clock = self._clock
        inflight: deque[_InFlight] = deque()
        while True:
            now = clock.now()
            wake_at_s: float | None = None
            while len(inflight) < replica.pipeline_depth:
                # With a batch already on the replica, only a full one may queue behind
                # it: a batch that could still grow waits until the replica is free.
                behind = inflight[-1].batch.lead_class if inflight else None
                decision = self._decide(now, behind_class=behind)
                if decision.batch is None:
                    times = (decision.wake_at_s, decision.ages_at_s)
                    wake_at_s = min((t for t in times if t is not None), default=None)
                    break
                if self._queues.num_live and self._idle:
                    self._wake_one()
                inflight.append(self._launch(replica, decision.batch, now))
            if inflight:
                landing = inflight.popleft()
                # The class still occupies this replica while its next batch waits here.
                holds_replica = any(
                    f.batch.lead_class == landing.batch.lead_class for f in inflight
                )
                await self._land(replica, landing, holds_replica)
                if replica.blocks_loop:
                    await io_turn()
                continue
            if self._state is not _State.RUNNING and self._queues.num_live == 0:
                # A replica that idled while draining (its class at its share cap) is
                # owed no other wake-up once the last request was cancelled or expired.
                self._wake_all()
                return
            if replica.idle_since_s is None:
                replica.idle_since_s = now
            await self._idle_wait(wake_at_s)

    def _decide(self, now: float, *, behind_class: str | None) -> Decision:
        return self._scheduler.decide(
            now,
            self._policy,
            self._queues,
            num_replicas=len(self._replicas),
            max_items_cap=self._oom.current(now, self._policy),
            is_draining=self._state is _State.DRAINING,
            expire=self._expire,
            require_full=behind_class is not None,
            behind_class=behind_class,
        )

    async def _idle_wait(self, wake_at_s: float | None) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(waiter)
        timer = None
        if wake_at_s is not None:
            timer = self._clock.call_at(wake_at_s, lambda: _wake(waiter))
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            # Closed: its loop was closed under it, and this coroutine is being discarded.
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.cancel()
            if waiter in self._idle:  # woken by its timer, not popped by a submit
                self._idle.remove(waiter)

    def _wake_one(self) -> None:
        idle = self._idle
        while idle:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        while self._idle:
            _wake(self._idle.popleft())

    def _launch(self, replica: Replica, batch: Batch, now: float) -> _InFlight:
        """Mark the batch's requests running and start the model on each group."""
        idle_since = replica.idle_since_s
        replica.idle_since_s = None
        if idle_since is not None:
            oldest = min(r.arrival_s for r in batch.requests)
            replica.counters.fill_wait_s += max(0.0, now - max(idle_since, oldest))
        batch.start(replica.replica_id, now, idle_since)
        groups = by_signature(batch.requests)
        cancels = self._cancels[batch.batch_id] = _Cancels()
        attempts = [self._start(replica, g, cancels) for g in groups]
        return _InFlight(batch, groups, attempts, now, cancels)

    def _starter(
        self, replica: Replica, cancels: _Cancels
    ) -> Callable[[list[Request]], Awaitable[RunOutput]]:
        return lambda requests: self._start(replica, requests, cancels)

    def _start(
        self, replica: Replica, requests: list[Request], cancels: _Cancels
    ) -> Awaitable[RunOutput]:
        collator = self._intake.collator
        assert collator is not None, "a request was admitted, so the collator is known"
        deadlines = [r.deadline_s for r in requests if r.deadline_s is not None]
        return replica.start(
            collator,
            [r.payload for r in requests],
            [r.is_many for r in requests],
            [r.num_items for r in requests],
            min(deadlines) if deadlines else None,
            lambda: cancels.seen and any(r.future.cancelled() for r in requests),
        )

    async def _land(self, replica: Replica, inflight: _InFlight, holds_replica: bool) -> None:
        """Wait for a launched batch and answer each of its requests."""
        batch = inflight.batch
        # A batch queued behind another cannot have started before that one ended.
        started_s = max(inflight.launched_s, replica.last_landed_s)
        try:
            for i, (group, attempt) in enumerate(
                zip(inflight.groups, inflight.attempts, strict=True)
            ):
                output = await self._settler.settle(
                    group, attempt, self._starter(replica, inflight.cancels)
                )
                if i == 0 and output is not None:
                    started_s = output.started_s
        finally:
            for attempt in inflight.attempts:
                if inspect.iscoroutine(attempt):
                    attempt.close()  # never started if an earlier group was cancelled
            self._cancels.pop(batch.batch_id, None)
            end = self._clock.now()
            replica.last_landed_s = end
            self._telemetry.batch_done(batch, replica.counters, max(0.0, end - started_s))
            if self._intake.has_lengths:
                self._telemetry.tokens(*self._intake.token_slots(inflight.groups))
            if self._memory_probe is not None:
                try:
                    used, total = self._memory_probe()
                except Exception:
                    log.exception("memory_probe of %r raised; sample skipped", self._name)
                else:
                    self._telemetry.memory(used, total)
            queue = self._queues.leading(batch.lead_class)
            if queue is not None and not holds_replica:
                queue.num_running -= 1
            if self._queues.num_live and self._idle:
                self._wake_one()

    # -- deadlines, cancellation, out of memory -----------------------------------------

    def _on_deadline(self, request: Request) -> None:
        if request.state is _QUEUED:
            self._expire(request)

    def _expire(self, request: Request) -> None:
        self._drop(request, Outcome.EXPIRED)

    def _drop(self, request: Request, outcome: Outcome) -> None:
        """Take a QUEUED request out of the running: expired, cancelled or closed."""
        request.state = (
            RequestState.CANCELLED if outcome is Outcome.CANCELLED else RequestState.EXPIRED
        )
        self._queues.forget(request)
        if request.timer is not None:
            request.timer.cancel()
            request.timer = None
        now = self._clock.now()
        future = request.future
        if not future.done():
            if outcome is Outcome.EXPIRED:
                assert request.deadline_s is not None
                timeout_s = request.deadline_s - request.arrival_s
                error: CarpoolError = DeadlineExceeded(
                    request.request_id, timeout_s, now - request.arrival_s
                )
            else:
                error = Closed(self._name)
            future.set_exception(error)
        self._telemetry.answered(request, outcome, now)

    # -- policy and telemetry ---------------------------------------------------------

    def set_policy(self, policy: BatchPolicy) -> None:
        """Replace the policy while running; takes effect at the next batch.

        Raises:
            ConfigError: not a BatchPolicy, a token budget the collator in use cannot
                measure, or what the batcher's ``policy_check`` refuses.
        """
        if not isinstance(policy, BatchPolicy):
            raise ConfigError("policy", policy, "a BatchPolicy")
        if self._policy_check is not None:
            self._policy_check(policy)
        self._intake.check(policy)
        self._queues.reconfigure(policy)
        self._policy = policy
        self._telemetry.set_classes({c.name: c.slo_s for c in policy.classes})
        self._wake_all()

    def update_policy(self, **changes: Any) -> BatchPolicy:
        """Change policy fields while running (validated first); returns the new policy."""
        policy = self._policy.replace(**changes)
        self.set_policy(policy)
        return policy

    def snapshot(self, *, quantiles: bool = True) -> TelemetrySnapshot:
        """Everything measured so far, as frozen typed values. ``quantiles=False`` skips
        the percentiles (``p*_s`` and ``max_s`` are NaN), which sort the recent samples:
        a scraper that needs only counts, sums and buckets (``/metrics``) asks for that."""
        uptime = self._clock.now() - self._started_s if self._replicas else 0.0
        return self._telemetry.snapshot(
            uptime,
            self._queues.pending_by_class(),
            [r.counters for r in self._replicas],
            quantiles=quantiles,
        )


@dataclass(slots=True)
class _InFlight:
    """A batch handed to a replica: its signature groups and their model calls."""

    batch: Batch
    groups: list[list[Request]]
    attempts: list[Awaitable[RunOutput]]
    launched_s: float
    cancels: _Cancels


class _Cancels:
    """Whether a caller cancelled a request of a launched batch. Set on the loop, read by
    the replica's thread when one of the batch's model calls reaches its turn: only then
    are the call's requests looked at, so a batch nobody cancels pays one attribute read
    per call."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False


def _check_options(
    policy: object,
    name: object,
    clock: object,
    slow_request_s: object,
    *hooks: object,
) -> None:
    """Refuse a Batcher argument of the wrong kind when it is built: otherwise a hook that
    is not callable fails every batch (logged and skipped) and a policy dict fails with an
    AttributeError far from the call that passed it."""
    if policy is not None and not isinstance(policy, BatchPolicy):
        raise ConfigError(
            "policy", policy, "a BatchPolicy, as Batcher(fn, BatchPolicy(max_batch_size=64))"
        )
    if name is not None and not isinstance(name, str):
        raise ConfigError("name", name, "a string or None")
    if clock is not None and not all(callable(getattr(clock, m, None)) for m in ("now", "call_at")):
        raise ConfigError("clock", clock, "a Clock: an object with now() and call_at()")
    if slow_request_s is not None and not (
        isinstance(slow_request_s, int | float)
        and not isinstance(slow_request_s, bool)
        and 0 <= slow_request_s < math.inf
    ):
        raise ConfigError("slow_request_s", slow_request_s, "a finite number of seconds >= 0")
    expected = (
        ("fn", "a callable taking one batch"),
        ("fn_factory", "a callable taking a device string and returning the model"),
        ("on_trace", "a callable taking a RequestTrace, or None"),
        ("memory_probe", "a callable returning (used_bytes, total_bytes), or None"),
        ("policy_check", "a callable taking a BatchPolicy, or None"),
    )
    for (hook_name, what), hook in zip(expected, hooks, strict=True):
        if hook is not None and not callable(hook):
            raise ConfigError(hook_name, hook, what)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
