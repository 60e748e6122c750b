"""The public async face of the batching engine: submit, start, stop.

A :class:`Batcher` takes requests (checked, queued, and an idle replica loop woken: the
request path, kept to that), holds the policy and reports what was measured. Starting,
stopping and draining come from its base class, :class:`~carpool.core.lifecycle.Lifecycle`;
its :class:`~carpool.core.dispatch.Dispatcher` runs the batches: one loop per replica
pulls the next batch when the replica is free, so batches grow with load.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from carpool.core.adaptive import Adaptive, AdaptiveState
from carpool.core.admission import Intake, OomCap, deadline, inspect_payload, request_cost
from carpool.core.batch_times import BatchTimes
from carpool.core.buffer_pool import DEFAULT_BUFFER_POOL_MB, BufferPool, check_pool_options
from carpool.core.clock import Clock, MonotonicClock
from carpool.core.collate import Collator
from carpool.core.dispatch import Dispatcher
from carpool.core.lifecycle import Lifecycle, State
from carpool.core.model_source import process_source
from carpool.core.options import check_options
from carpool.core.policy import BatchPolicy, ClassLimits
from carpool.core.process_replica import check_replica_cpus
from carpool.core.queue_time import check_queue_time, predict_wait_s
from carpool.core.queues import Queues
from carpool.core.ray_replica import ray_replica_maker
from carpool.core.replicas import BatchFn, FnFactory, check_threading, replica_devices
from carpool.core.request import Batch, Outcome, Request, RequestState
from carpool.core.scheduler import Decision, Scheduler, request_units, requests_by_class
from carpool.core.telemetry import (
    MemoryProbe,
    NullTelemetry,
    Telemetry,
    TelemetrySnapshot,
    TraceHook,
    guarded_hook,
)
from carpool.errors import Closed, ConfigError, InvalidInput, QueueFull

_QUEUED = RequestState.QUEUED


class Batcher(Lifecycle):
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
            one CPU, where a thread would only take turns with the loop on that core;
            ``"process"``, each replica in its own spawned process (``fn`` or
            ``fn_factory`` picklable, or ``fn_factory`` a ``"module:attr"`` string):
            see :mod:`carpool.core.process_replica`.
        policy_check: called with the policy at construction and with every new one
            (``set_policy``/``update_policy``); raises ConfigError for a policy the model
            cannot serve (a token budget smaller than one item the model may take).
        replica_cpus: with ``executor="process"``, the CPUs each replica's process is
            pinned to (``[[0], [1]]``); its torch threads are set to match.
        buffer_pool: collate into buffers reused batch after batch (on by default; see
            :mod:`carpool.core.buffer_pool`); ``buffer_pool_mb`` bounds the idle ones.
        ray_resources: with ``executor="ray"`` (each replica a Ray actor, ``fn`` or
            ``fn_factory`` as for ``"process"``: see :mod:`carpool.core.ray_replica`),
            the Ray resources each actor takes, as ``{"num_cpus": 1, "num_gpus": 1}``
            (default ``{"num_cpus": 1}``).
        max_restarts: with ``executor="ray"``, how often Ray restarts a dead actor
            before carpool creates another (default 3; -1: no limit).
        ray_placement: with ``executor="ray"``, ``{"strategy": "STRICT_SPREAD"}`` (or
            ``PACK``, ``SPREAD``, ``STRICT_PACK``): the replicas reserved together in a Ray
            placement group, one bundle of ``ray_resources`` each (see
            :mod:`carpool.core.ray_placement`); None: placed one by one.

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
        fn_factory: FnFactory | str | None = None,
        collate: str | Collator = "auto",
        clock: Clock | None = None,
        on_trace: TraceHook | None = None,
        slow_request_s: float | None = None,
        memory_probe: MemoryProbe | None = None,
        telemetry: bool = True,
        switch_interval_s: float | None = 0.0005,
        executor: str = "auto",
        policy_check: Callable[[BatchPolicy], None] | None = None,
        replica_cpus: list[list[int]] | None = None,
        buffer_pool: bool = True,
        buffer_pool_mb: float = DEFAULT_BUFFER_POOL_MB,
        ray_resources: dict[str, float] | None = None,
        max_restarts: int | None = None,
        ray_placement: dict[str, str] | None = None,
    ) -> None:
        if (fn is None) == (fn_factory is None):
            raise ConfigError("fn", fn, "exactly one of fn or fn_factory")
        if isinstance(fn_factory, str) and executor not in ("process", "ray"):
            raise ConfigError(
                "fn_factory", fn_factory, "a callable ('module:attr' needs process or ray)"
            )
        check_options(
            policy,
            name,
            clock,
            slow_request_s,
            fn,
            None if isinstance(fn_factory, str) else fn_factory,
            on_trace,
            memory_probe,
            policy_check,
        )
        self._policy_check = policy_check
        self._memory_probe = memory_probe
        name = name or getattr(fn or fn_factory, "__name__", None) or "model"
        self._devices = replica_devices(num_replicas, devices)
        if executor in ("process", "ray"):
            process_source(fn, fn_factory, executor)  # ConfigError now, not when it starts
        if replica_cpus is not None and executor != "process":
            raise ConfigError("replica_cpus", replica_cpus, "None unless executor='process'")
        make_replicas = ray_replica_maker(
            executor,
            name,
            self._devices,
            fn,
            fn_factory,
            ray_resources,
            max_restarts,
            ray_placement,
        )
        cpus = check_replica_cpus(replica_cpus, len(self._devices))
        self._policy = policy if policy is not None else BatchPolicy()
        self.first_policy = self._policy  # what it was built with (a server's config)
        self._policy_version = 0
        if policy_check is not None:
            policy_check(self._policy)
        check_pool_options(buffer_pool, buffer_pool_mb)
        self._pool = (
            BufferPool(
                int(buffer_pool_mb * 2**20),
                self._policy.preferred_batch_sizes,
                pin_memory=any(d.startswith("cuda") for d in self._devices),
            )
            if buffer_pool
            else None
        )
        self._intake = Intake(collate, self._pool)
        clock = clock if clock is not None else MonotonicClock()
        check_threading(switch_interval_s, executor)
        telemetry_cls = Telemetry if telemetry else NullTelemetry
        recorder = telemetry_cls(
            name,
            {n: lim.slo_s for n, lim in self._policy.limits.items()},
            on_trace=None if on_trace is None else guarded_hook(on_trace, name),
            slow_request_s=slow_request_s,
        )
        queues = Queues(self._policy)
        self._scheduler = Scheduler()
        if self._intake.collator is not None:
            self._adopt(self._intake.collator)
        else:
            self._intake.check(self._policy)
        self._request_ids = itertools.count()
        self._oom = OomCap()
        self._batch_times = BatchTimes(clock, self._policy.budget_unit)
        self._adaptive = Adaptive(self._batch_times.fit)
        self._is_adaptive = self._policy.is_adaptive
        dispatch = Dispatcher(
            name,
            devices=self._devices,
            fn=fn,
            fn_factory=fn_factory,
            executor=executor,
            clock=clock,
            queues=queues,
            intake=self._intake,
            telemetry=recorder,
            oom=self._oom,
            memory_probe=memory_probe,
            switch_interval_s=switch_interval_s,
            decide=self._decide,
            batch_times=self._batch_times,
            batch_timeout_s=self._policy.batch_timeout_s,
            replica_cpus=cpus,
            make_replicas=make_replicas,
        )
        super().__init__(name, clock=clock, queues=queues, telemetry=recorder, dispatch=dispatch)
        # The request path wakes an idle replica loop without a hop through the
        # dispatcher: the same IdleReplicas, the same bound method.
        self._idle = dispatch.idle
        self._wake_one = dispatch.wake_one
        dispatch.preempt = self._policy.preempt
        dispatch.on_landed = self._landed

    # -- properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    @property
    def policy_version(self) -> int:
        """Times the policy was replaced (``set_policy``, ``update_policy``): what a caller
        worked out from it (a cached request's class and deadline) holds while unchanged."""
        return self._policy_version

    @property
    def is_running(self) -> bool:
        return self._state is State.RUNNING

    @property
    def is_ready(self) -> bool:
        """Running, with a replica that can take a batch (not all being replaced)."""
        return self._state is State.RUNNING and self._dispatch.is_healthy

    @property
    def buffer_pool(self) -> BufferPool | None:
        """The pool batches are collated into (``buffer_pool=True``), else None."""
        return self._pool

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
    def memory_probe(self) -> MemoryProbe | None:
        """What reports the runner's memory after each batch, if anything does."""
        return self._memory_probe

    @property
    def effective_max_batch_size(self) -> int:
        """``max_batch_size``, or less while recovering from out of memory."""
        max_size = self._policy.size_limit
        cap = self._oom.current(self._clock.now(), self._policy)
        return max_size if cap is None else min(cap, max_size)  # max may be lowered since

    # -- submitting -------------------------------------------------------------------

    async def submit(
        self,
        payload: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Any:
        """Run one item in some batch and return its own output.

        Args:
            payload: one item (the batch stacks items along a new axis 0).
            priority: a class name of the policy; the default class when omitted.
            timeout_s: deadline from its arrival; the class's ``timeout_s`` when omitted.
            cost: this request's cost; ``cost_fn(payload)`` or its item count when omitted.
            arrival_s: when the request arrived, on the batcher's clock (a server passes
                when its first byte came); now when omitted or later than now.

        Raises:
            InvalidInput, QueueFull, DeadlineExceeded, ModelError, CapacityError, Closed.
        """
        return await self._submit(payload, False, priority, timeout_s, cost, arrival_s)

    async def submit_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Any:
        """Run k items (along axis 0 of ``payloads``) in one batch; returns k outputs."""
        return await self._submit(payloads, True, priority, timeout_s, cost, arrival_s)

    def enqueue_many(
        self,
        payloads: Any,
        *,
        priority: str | None = None,
        timeout_s: float | None = None,
        cost: float | None = None,
        arrival_s: float | None = None,
    ) -> Request:
        """Queue k items (along axis 0 of ``payloads``) without awaiting them.

        For callers on the loop that cannot afford a task per request (the server's HTTP
        fast path): the returned request's ``future`` resolves to the k outputs, or to the
        error :meth:`submit_many` would raise; :meth:`cancel` withdraws it.
        ``arrival_s``: when the request arrived, on this batcher's clock (a server passes
        when its first byte was read); its deadline and latency count from then. Now when
        omitted, or when later than now.

        Raises:
            Closed: the batcher is not running. And what :meth:`submit_many` raises
            before queueing: InvalidInput, QueueFull.
        """
        if self._state is not State.RUNNING:
            raise Closed(self._name)
        return self._make_request(payloads, True, priority, timeout_s, cost, arrival_s)

    def refuse_early(self, num_reserved: int = 0) -> QueueFull | None:
        """The :class:`QueueFull` a request would get now whatever its class (counted for
        the model, its class unknown: ``num_refused_from_head``), or None: lets a server
        refuse a request from its head, before reading or decoding its body, when every
        queue it could join is at its bound (counting ``num_reserved`` requests a server
        promised a place)."""
        error = self._queues.full(num_reserved)
        if error is not None:
            self._telemetry.refused_from_head()
        return error

    def refuse_unknown_priority(self, priority: object, num_requests: int = 1) -> InvalidInput:
        """The error :meth:`submit` gives a ``priority`` naming no class, counted as it
        counts it (``invalid``, under the default class): for a face that names it itself."""
        self._telemetry.rejected(self._policy.default_class, "invalid", num_requests)
        classes = list(self._policy.limits)
        return InvalidInput(f"unknown priority {priority!r}: expected one of {classes}")

    @property
    def num_free(self) -> int:
        """How many more requests the queues could admit now (many if a class is unbounded)."""
        return self._queues.num_free()

    def cancel(self, request: Request) -> None:
        """Withdraw a request from :meth:`enqueue_many`: dropped unanswered if still
        queued (the model never sees it), also if its batch still waits for the replica
        (behind the batch the replica computes); its result ignored if already running."""
        request.future.cancel()
        self._withdraw(request)

    def _withdraw(self, request: Request) -> None:
        """Take out a request whose future its caller cancelled."""
        if request.state is _QUEUED:
            self._dispatch.drop(request, Outcome.CANCELLED)
        elif request.state is RequestState.RUNNING:
            self._dispatch.note_cancelled(request)

    async def _submit(
        self,
        payload: Any,
        is_many: bool,
        priority: str | None,
        timeout_s: float | None,
        cost: float | None,
        arrival_s: float | None,
    ) -> Any:
        if self._state is not State.RUNNING:
            if self._state is not State.NEW:
                raise Closed(self._name)
            await self.start()
        elif not self._is_on_its_loop():
            # Started by an earlier asyncio.run(): its replica tasks ended with its loop.
            self._leave_closed_loop()  # raises if that loop is still open
            await self.start()
        if self._state is not State.RUNNING:
            # It waited on another caller's start, who stopped it meanwhile: queued now,
            # nothing would ever run it.
            raise Closed(self._name)
        request = self._make_request(payload, is_many, priority, timeout_s, cost, arrival_s)
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
        arrival_s: float | None = None,
    ) -> Request:
        policy = self._policy
        if priority is None:
            limits = policy.limits.get(policy.default_class)
        else:
            limits = policy.limits.get(priority) if isinstance(priority, str) else None
        if limits is None:
            raise self.refuse_unknown_priority(priority)
        loop = self._loop  # not asyncio.get_running_loop(): that makes a getpid() syscall
        assert loop is not None, "requests are made only after start()"
        intake = self._intake
        collator = intake.collator
        if collator is None:
            collator = self._adopt(intake.choose(payload))
        now = self._clock.now()
        if arrival_s is not None and arrival_s < now:
            now = arrival_s
        try:
            num_items, signature = inspect_payload(collator, payload, is_many)
            cost = request_cost(policy, limits, payload, num_items, cost)
            lengths = intake.lengths(payload, is_many, policy) if intake.has_lengths else None
            deadline_s = deadline(now, timeout_s, limits)
        except InvalidInput:
            self._telemetry.rejected(limits.name, "invalid")
            raise
        # In field order, positionally: cheaper than by keyword on the request path
        # (docs/benchmarks.md); a test pins each field to its name.
        request = Request(
            next(self._request_ids),  # request_id
            payload,
            num_items,
            is_many,
            cost,
            limits.name,  # class_name
            limits.rank,
            now,  # arrival_s
            deadline_s,
            loop.create_future(),  # future
            signature,
        )
        if lengths is not None:
            request.num_tokens, request.length, request.bucket = lengths
        try:
            if limits.bounds_queue_time:
                self._check_queue_time(request, limits, now)
            self._queues.admit(request)
        except QueueFull:
            self._telemetry.rejected(limits.name, "queue_full")
            if self._is_adaptive:
                units = request_units(request, self._policy.budget_unit)
                self._adaptive.refused(limits.name, now, units)
            raise
        self._telemetry.admitted(request)
        if self._is_adaptive:
            had_company = self._queues.by_name[limits.name].num_live > 1
            units = request_units(request, self._policy.budget_unit)
            self._adaptive.arrived(limits.name, now, had_company, units=units)
        if deadline_s is not None:
            request.timer = self._clock.call_at(deadline_s, lambda: self._on_deadline(request))
        if self._idle:
            self._wake_one()
        if self._policy.preempt:
            self._dispatch.note_queued(limits.rank)
        return request

    def _check_queue_time(self, request: Request, limits: ClassLimits, now: float) -> None:
        """Refuse ``request`` if the work queued ahead breaks its class's bound in time."""
        policy, predict_s = self._policy, self._batch_times.predict_s
        wait_s, own_s = predict_wait_s(
            self._queues,
            limits,
            request_units(request, policy.budget_unit),
            policy.budget_unit,
            lambda: (
                self._adaptive.admission_cap(policy, limits, now)
                if self._is_adaptive
                else policy.unit_limit(limits)
            ),
            len(self._dispatch.replicas),
            lambda: self._dispatch.busy_left_s(now, predict_s),
            predict_s,
        )
        check_queue_time(limits, wait_s, own_s)

    def _adopt(self, collator: Collator) -> Collator:
        self._intake.adopt(collator, self._policy)
        self._scheduler.padded_cost = self._intake.pads
        return collator

    # -- decisions and deadlines ------------------------------------------------------

    def _decide(
        self, now: float, *, behind_class: str | None, above_class: str | None = None
    ) -> Decision:
        """The dispatcher's replica loops ask this for their next batch; with
        ``above_class``, for one of the classes above it (``preempt``: scheduler rule 6)."""
        above = None if above_class is None else self._policy.limits.get(above_class)
        if above_class is not None and (above is None or not self._policy.preempt):
            return Decision()
        if self._is_adaptive:
            self._adaptive.preempts = self._policy.preempt and self._dispatch.preempts
        decision = self._scheduler.decide(
            now,
            self._policy,
            self._queues,
            num_replicas=len(self._dispatch.replicas),
            max_items_cap=self._oom.current(now, self._policy),
            is_draining=self._state is State.DRAINING,
            expire=self._dispatch.expire,
            require_full=behind_class is not None,
            behind_class=behind_class,
            predict_s=self._batch_times.predict_at_least_s,  # it drops only the surely late
            adaptive=self._adaptive if self._is_adaptive else None,
            above_rank=None if above is None else above.rank,
        )
        if self._is_adaptive and decision.batch is not None:
            for name in {r.class_name for r in decision.batch.requests}:
                if self._queues.by_name[name].num_live == 0:
                    self._adaptive.emptied(name, now)
        return decision

    def _on_deadline(self, request: Request) -> None:
        if request.state is _QUEUED:
            self._dispatch.expire(request)

    # -- policy and telemetry ---------------------------------------------------------

    def set_trace_hook(self, hook: TraceHook | None) -> None:
        """Call ``hook`` with each finished request's trace from now on (None: no trace)."""
        self._telemetry.on_trace = None if hook is None else guarded_hook(hook, self._name)

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
        if self._pool is not None:  # size buckets follow the preferred sizes
            self._pool.preferred = policy.preferred_batch_sizes
        self._queues.reconfigure(policy)
        if policy.budget_unit != self._policy.budget_unit:
            # Times, line and rates count the old unit (read as the new, 200 ms batches).
            self._batch_times.forget(policy.budget_unit)
            self._adaptive.forget()
        self._policy = policy
        self._is_adaptive = policy.is_adaptive
        self._policy_version += 1
        self._dispatch.watchdog.timeout_s = policy.batch_timeout_s
        self._dispatch.preempt = policy.preempt
        self._telemetry.set_classes({n: lim.slo_s for n, lim in policy.limits.items()})
        self._dispatch.wake_all()

    def update_policy(self, **changes: Any) -> BatchPolicy:
        """Change policy fields while running (validated first); returns the new policy."""
        policy = self._policy.replace(**changes)
        self.set_policy(policy)
        return policy

    def _landed(self, batch: Batch, now: float) -> None:
        if self._is_adaptive:
            self._adaptive.answered(now, requests_by_class(batch.requests))

    def adaptive_state(self) -> AdaptiveState | None:
        """What "auto" has in force now, per class, and the fitted line; None without it."""
        if not self._is_adaptive:
            return None
        return self._adaptive.state(self._policy, self._clock.now())

    def snapshot(self, *, quantiles: bool = True) -> TelemetrySnapshot:
        """Everything measured so far, as frozen typed values. ``quantiles=False`` skips the
        percentiles (NaN), which sort recent samples: for a scrape of counts (``/metrics``)."""
        replicas = self._dispatch.replica_counters()
        uptime = self._clock.now() - self._started_s if replicas else 0.0
        return self._telemetry.snapshot(
            uptime, self._queues.pending_by_class(), replicas, quantiles=quantiles
        )
