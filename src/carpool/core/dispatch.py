"""Where a batcher's batches run: its replicas, the loop each one runs, the batches in flight.

Each replica runs one loop: ask the scheduler for a batch; if there is one, run it;
if not, sleep until a request arrives or the oldest request's delay expires. A batch is
therefore closed only when a replica is free to run it, and while every replica is busy
requests pile up, so batches grow with load (pull-based, least-loaded by construction).
When a batch is ready and several replicas are idle, the one woken to take it is the one
least busy lately (:mod:`carpool.core.idle`): its time computing, decayed with a time
constant of ``BUSY_DECAY_S``, is the lowest. Waking the longest-idle one instead gives
each replica about the same gap between batches whatever its speed, which leaves fast
replicas less busy than slow ones. For a delay that runs out, idle replicas share one
timer, which wakes the least busy of them too. A batcher with one replica has no choice
to make: its loop keeps no busy time and waits with a timer of its own, cancelled when a
request wakes it, as before least-busy dispatch (the shared timer is not cancelled when
a request wakes a replica, so it woke a lone replica once more, for nothing, after a
batch that filled before its delay ran out).

A batch that raises is bisected until the failing requests are found; only they get a
:class:`ModelError`. Out of memory splits the batch into halves, retries them, and lowers
the effective max batch size until ``oom_recovery_s`` passes without another (the
:class:`~carpool.core.settle.Settler` does both as each batch lands).

A request taken out of the queue before it runs (its deadline passed, its caller
cancelled it, the batcher closed without draining) is answered here too: :meth:`drop`.

A batch that runs past ``batch_timeout_s`` fails with :class:`BatchTimeout` and its
replica goes on with a fresh thread (:mod:`carpool.core.watchdog`); its loop waits for the
replica's model to be built again before it takes the next batch. :meth:`cut_off` ends
what a drain has not finished in time: every request left fails with :class:`Closed`.

Under a policy with ``preempt`` (the batcher sets :attr:`Dispatcher.preempt`), a replica
that computes a batch in steps on the event loop does not only wait for it: a request of
a class above that batch's lead class wakes it (``note_queued``, see
:mod:`carpool.core.preempt`), and it asks for a batch of the classes above, which runs
between the lower batch's steps (the replica's :class:`~carpool.core.stepwise.StepGate`
holds the lower one back) and is answered first.

A :class:`~carpool.core.batcher.Batcher` owns one :class:`Dispatcher`. The batcher keeps
the requests' intake, the policy and the lifecycle's state; it hands the dispatcher the
scheduler's decisions through :class:`Decide`, tells it when to load, run, drain and
join, and wakes an idle replica loop when it queues a request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from carpool.core.admission import Intake, OomCap
from carpool.core.batch_times import BatchTimes
from carpool.core.clock import Clock, TimerHandle
from carpool.core.idle import BusyTime, IdleReplicas, wake
from carpool.core.model_call import Cancels, ModelCall, RunOutput
from carpool.core.model_source import process_source
from carpool.core.preempt import Preemptions
from carpool.core.process_replica import process_replicas
from carpool.core.queues import Queues
from carpool.core.replicas import (
    BatchFn,
    FnFactory,
    Replica,
    ReplicaLike,
    io_turn,
    switch_interval,
)
from carpool.core.request import Batch, Outcome, Request, RequestState
from carpool.core.scheduler import Decision
from carpool.core.settle import Settler, by_signature
from carpool.core.telemetry import MemoryProbe, ReplicaCounters, Telemetry
from carpool.core.watchdog import Watchdog
from carpool.errors import CarpoolError, Closed, DeadlineExceeded

log = logging.getLogger("carpool")

# A replica whose model fails to build again after a hang tries again after this, then
# after twice as long, up to RENEW_WAIT_MAX_S.
RENEW_WAIT_S = 1.0
RENEW_WAIT_MAX_S = 30.0


class Decide(Protocol):
    """The batcher's call to its scheduler: a batch for a replica now, or when to look again.
    ``behind_class`` is the lead class of the batch the replica already holds, if any."""

    def __call__(
        self, now: float, *, behind_class: str | None, above_class: str | None = None
    ) -> Decision: ...


class Dispatcher:
    """Runs one batcher's batches on its replicas (see the module docstring).

    ``idle`` holds a future per replica loop waiting for work, least busy lately first:
    the batcher holds the same :class:`IdleReplicas` (it is cleared, never rebound) and
    calls :meth:`wake_one` when it queues a request.
    """

    def __init__(
        self,
        name: str,
        *,
        devices: list[str],
        fn: BatchFn | None,
        fn_factory: FnFactory | str | None,
        executor: str,
        clock: Clock,
        queues: Queues,
        intake: Intake,
        telemetry: Telemetry,
        oom: OomCap,
        memory_probe: MemoryProbe | None,
        switch_interval_s: float | None,
        decide: Decide,
        batch_times: BatchTimes | None = None,
        batch_timeout_s: float | None = None,
        replica_cpus: list[list[int]] | None = None,
        make_replicas: Callable[[Watchdog], Sequence[ReplicaLike]] | None = None,
    ) -> None:
        self._name = name
        self._make_replicas = make_replicas  # replicas of another kind (executor="ray")
        self._replica_cpus = replica_cpus
        self._devices = devices
        self._fn = fn
        self._fn_factory = fn_factory
        self._executor = executor
        self._clock = clock
        self._queues = queues
        self._intake = intake
        self._telemetry = telemetry
        self._memory_probe = memory_probe
        self._switch_interval_s = switch_interval_s
        self._holds_switch_interval = False
        self._decide = decide
        self._batch_times = batch_times
        self._settler = Settler(telemetry, clock, oom, name)
        self.watchdog = Watchdog(clock, batch_timeout_s)  # the batcher sets its timeout_s
        self.replicas: list[ReplicaLike] = []  # kept after join(): their counters stay readable
        self._tasks: list[asyncio.Task[None]] = []
        self.idle = IdleReplicas()
        # One timer for all idle replicas: when the earliest of them asked to look again
        # (a request's delay runs out), the least busy idle one is woken.
        self._due: TimerHandle | None = None
        self._due_s = math.inf
        # Each launched batch, by batch id, until it lands.
        self._launched: dict[int, _InFlight] = {}
        # Told of each batch as it lands, with the time (the adaptive controller's hook).
        self.on_landed: Callable[[Batch, float], None] | None = None
        self.is_draining = False  # no request comes any more: loops end on empty queues
        self.preempt = False  # the policy's preempt: the batcher keeps it current
        self.preempts = False  # a batch ran in steps on the loop: preempting can work
        self._preemptions = Preemptions(clock)
        self.note_queued = self._preemptions.note_queued  # a request of a class queued

    # -- lifecycle: the batcher's start, stop and return from a closed loop -----------

    async def load(self) -> None:
        """Load a replica per device (all are closed if one fails) and, while one runs on
        a thread, hold the interpreter's GIL switch interval."""
        replicas: list[ReplicaLike]
        if self._make_replicas is not None:
            replicas = list(self._make_replicas(self.watchdog))
        elif self._executor == "process":
            source = process_source(self._fn, self._fn_factory)
            replicas = list(
                process_replicas(
                    self._name,
                    self._devices,
                    source,
                    self._clock.now,
                    self.watchdog,
                    self._replica_cpus,
                )
            )
        else:
            replicas = [self._thread_replica(i, device) for i, device in enumerate(self._devices)]
        try:
            await asyncio.gather(*(r.load() for r in replicas))
        except BaseException:
            for replica in replicas:
                replica.close()
            raise
        self.replicas = replicas
        if self.watchdog.timeout_s is not None and any(r.blocks_loop for r in replicas):
            log.warning(
                "model %r runs on the event loop's thread (executor=%r): batch_timeout_s=%g "
                "cannot stop a batch that hangs there, and such a hang stops the whole "
                "server, health checks included; give it executor: thread to have it enforced",
                self._name,
                self._executor,
                self.watchdog.timeout_s,
            )
        if any(r.is_threaded for r in replicas):
            self._hold_switch_interval()

    def _hold_switch_interval(self) -> None:
        if self._switch_interval_s is not None and not self._holds_switch_interval:
            switch_interval.hold(self._switch_interval_s)
            self._holds_switch_interval = True

    def _thread_replica(self, i: int, device: str) -> Replica:
        factory = self._fn_factory
        assert not isinstance(factory, str), "a 'module:attr' factory runs in a process"
        return Replica(
            i,
            device,
            self._name,
            self._fn,
            factory,
            self._clock.now,
            self._executor,
            self.watchdog,
        )

    def run(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start each loaded replica's loop on ``loop``."""
        self.is_draining = False
        self._tasks = [
            loop.create_task(self._replica_loop(r), name=f"carpool-{self._name}-r{i}")
            for i, r in enumerate(self.replicas)
        ]

    def drain(self) -> None:
        """No request comes any more: each replica loop ends once the queues are empty."""
        self.is_draining = True
        self.wake_all()

    async def join(self) -> None:
        """Wait for every replica loop to end, then close the replicas (a loop that
        :meth:`cut_off` cancelled ends quietly; one that failed raises here)."""
        try:
            ended = await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._close_replicas()
            self._tasks = []
        for outcome in ended:
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError
            ):
                raise outcome

    def cut_off(self) -> int:
        """Stop now, without waiting for what is left: every queued or running request
        fails with :class:`Closed`, replicas still computing are given up (their threads
        left to return when they do) and every replica loop is cancelled. Returns how
        many requests were cut off."""
        self.is_draining = True
        num_cut_off = 0
        for queue in self._queues.ordered:
            for request in list(queue.live()):
                self.drop(request, Outcome.CLOSED)
                num_cut_off += 1
        now = self._clock.now()
        for launched in self._launched.values():
            for request in launched.batch.requests:
                if request.state is RequestState.RUNNING and not request.future.done():
                    request.state = RequestState.DONE
                    request.future.set_exception(Closed(self._name))
                    self._telemetry.answered(request, Outcome.CLOSED, now)
                    num_cut_off += 1
        for replica in self.replicas:
            replica.give_up()
        for task in self._tasks:
            task.cancel()
        self.wake_all()
        return num_cut_off

    @property
    def is_healthy(self) -> bool:
        """Whether a replica can run batches: not all are being replaced after a hang."""
        return any(r.is_healthy for r in self.replicas)

    def replica_counters(self) -> list[ReplicaCounters]:
        """Each replica's counters, with its count of stuck threads brought up to date."""
        for replica in self.replicas:
            replica.counters.num_stuck_threads = replica.num_stuck_threads
        return [r.counters for r in self.replicas]

    def busy_left_s(self, now: float, predict_s: Callable[[float], float]) -> float:
        """How long until a replica is free for the next batch, by the batch times
        measured (``predict_s``): 0 when one is idle or none holds a batch, else the least
        time a batch in flight has left."""
        if self.idle or not self._launched:
            return 0.0
        left = min(predict_s(f.batch.units) - (now - f.launched_s) for f in self._launched.values())
        return max(0.0, left)

    def abandon(self) -> None:
        """Forget replica loops whose event loop was closed under them: their idle waiters
        and the batches they held count for nothing now; the replicas are closed."""
        self.idle.clear()
        self._launched.clear()
        self._close_replicas()
        self.replicas, self._tasks = [], []

    def _close_replicas(self) -> None:
        self._disarm()
        for replica in self.replicas:
            replica.close()
        if self._holds_switch_interval:
            switch_interval.release()
            self._holds_switch_interval = False

    # -- waking idle replicas ---------------------------------------------------------

    def wake_one(self) -> None:
        """Wake the idle replica loop least busy lately."""
        take = self.idle.take
        while (waiter := take()) is not None:
            if not waiter.done():
                waiter.set_result(None)
                return

    def _arm(self, at_s: float) -> None:
        """Wake the least busy idle replica at ``at_s``, unless one is woken earlier."""
        if at_s >= self._due_s:
            return
        self._disarm()
        self._due_s = at_s
        self._due = self._clock.call_at(at_s, self._on_due)

    def _disarm(self) -> None:
        if self._due is not None:
            self._due.cancel()
        self._due, self._due_s = None, math.inf

    def _on_due(self) -> None:
        self._due, self._due_s = None, math.inf
        self.wake_one()

    def wake_all(self) -> None:
        take = self.idle.take
        while (waiter := take()) is not None:
            wake(waiter)

    # -- requests taken out: expired, cancelled, closed -------------------------------

    def note_cancelled(self, request: Request) -> None:
        """A launched request's caller cancelled it: its model call is asked, when its
        turn comes, whether to run."""
        launched = self._launched.get(request.batch_id)
        if launched is not None:
            launched.cancels.seen = True

    def expire(self, request: Request) -> None:
        self.drop(request, Outcome.EXPIRED)

    def drop(self, request: Request, outcome: Outcome) -> None:
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
                    request.request_id,
                    timeout_s,
                    now - request.arrival_s,
                    left_s=max(0.0, request.deadline_s - now),
                )
            else:
                error = Closed(self._name)
            future.set_exception(error)
        self._telemetry.answered(request, outcome, now)

    # -- replica loop -----------------------------------------------------------------

    async def _replica_loop(self, replica: ReplicaLike) -> None:
        clock = self._clock
        inflight: deque[_InFlight] = deque()
        # Only among several replicas is there one least busy to choose.
        busy = BusyTime() if len(self.replicas) > 1 else None
        while True:
            if not replica.is_healthy:
                await self._renewed(replica)
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
                if self._queues.num_live and self.idle:
                    self.wake_one()
                inflight.append(self._launch(replica, decision.batch, now))
            if inflight:
                landing = inflight.popleft()
                # The class still occupies this replica while its next batch waits here.
                holds_replica = any(
                    f.batch.lead_class == landing.batch.lead_class for f in inflight
                )
                if self.preempt and isinstance(replica, Replica) and replica.blocks_loop:
                    await self._land_preempted(replica, landing, holds_replica, busy)
                else:
                    await self._land(replica, landing, holds_replica, busy)
                if replica.blocks_loop:
                    await io_turn()
                elif not self._holds_switch_interval and replica.is_threaded:
                    self._hold_switch_interval()  # "auto" moved it off the loop
                continue
            if self.is_draining and self._queues.num_live == 0:
                # A replica that idled while draining (its class at its share cap) is
                # owed no other wake-up once the last request was cancelled or expired.
                self.wake_all()
                return
            if replica.idle_since_s is None:
                replica.idle_since_s = now
            await self._idle_wait(wake_at_s, busy)

    async def _land_preempted(
        self, replica: Replica, inflight: _InFlight, holds_replica: bool, busy: BusyTime | None
    ) -> None:
        """:meth:`_land`, running batches of higher classes meanwhile (module docstring):
        each is landed before the lower batch takes its next step."""
        lead = self._queues.by_name.get(inflight.batch.lead_class)
        if lead is None or lead.limits.rank == 0:
            await self._land(replica, inflight, holds_replica, busy)
            return
        rank, replica_id, gate = lead.limits.rank, replica.replica_id, replica.gate
        loop = asyncio.get_running_loop()
        landing = loop.create_task(self._land(replica, inflight, holds_replica, busy))
        try:
            while not landing.done():
                now = self._clock.now()
                lead_class = inflight.batch.lead_class
                decision = self._decide(now, behind_class=None, above_class=lead_class)
                if decision.batch is not None:
                    higher = self._launch(replica, decision.batch, now)
                    try:
                        await self._land(replica, higher, False, busy)
                    finally:
                        gate.release()
                    continue
                gate.release()  # nothing of a higher class is due yet
                await self._preemptions.wait(replica_id, rank, gate, landing, decision.wake_at_s)
        except BaseException:
            landing.cancel()
            raise
        finally:
            gate.release()  # a request queued as the lower batch ended held it
        await landing

    async def _renewed(self, replica: ReplicaLike) -> None:
        """Wait until a replica given up after a hang has its model again, building it
        again after a wait when its factory fails (waits double up to RENEW_WAIT_MAX_S)."""
        wait_s = RENEW_WAIT_S
        while True:
            try:
                await replica.renewed()
                return
            except Exception:
                log.exception(
                    "model %r, replica %d: building its model again after a hang failed; "
                    "trying again in %g s (the replica takes no batch meanwhile)",
                    self._name,
                    replica.replica_id,
                    wait_s,
                )
            await self._sleep(wait_s)
            wait_s = min(2 * wait_s, RENEW_WAIT_MAX_S)
            replica.renew()

    async def _sleep(self, delay_s: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self._clock.call_at(self._clock.now() + delay_s, lambda: wake(woken))
        try:
            await woken
        finally:
            timer.cancel()

    async def _idle_wait(self, wake_at_s: float | None, busy: BusyTime | None) -> None:
        """Wait for a request or until ``wake_at_s``: on the idle replicas' shared timer
        with ``busy`` (several replicas), on a timer of this wait's own without."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = None
        if busy is None:
            self.idle.push(waiter, 0.0)
            if wake_at_s is not None:
                timer = self._clock.call_at(wake_at_s, lambda: wake(waiter))
        else:
            self.idle.push(waiter, busy.key)
            if wake_at_s is not None:
                self._arm(wake_at_s)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            # Closed: its loop was closed under it, and this coroutine is being discarded.
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.cancel()
            self.idle.drop(waiter)  # woken by its own timer or cancelled, not taken

    def _launch(self, replica: ReplicaLike, batch: Batch, now: float) -> _InFlight:
        """Mark the batch's requests running and start the model on each signature group."""
        idle_since = replica.idle_since_s
        replica.idle_since_s = None
        if idle_since is not None:
            oldest = min(r.arrival_s for r in batch.requests)
            replica.counters.fill_wait_s += max(0.0, now - max(idle_since, oldest))
        batch.start(replica.replica_id, now, idle_since)
        collator = self._intake.collator
        assert collator is not None, "a request was admitted, so the collator is known"
        cancels = Cancels()
        calls = [ModelCall(group, collator, cancels) for group in by_signature(batch.requests)]
        attempts = [replica.start(call) for call in calls]
        launched = self._launched[batch.batch_id] = _InFlight(batch, calls, attempts, now, cancels)
        return launched

    async def _land(
        self, replica: ReplicaLike, inflight: _InFlight, holds_replica: bool, busy: BusyTime | None
    ) -> None:
        """Wait for a launched batch and answer each of its requests."""
        batch = inflight.batch
        # A batch queued behind another cannot have started before that one ended.
        started_s = max(inflight.launched_s, replica.last_landed_s)
        model_s: float | None = 0.0  # its steps' own time, when every call ran in steps
        # Whether every call ran once and was answered: only then is its span the model's
        # time for the batch. A failed call's span is its bisection's (or an exception's
        # at once), and fitted as the batch's it flattened the line the adaptive
        # controller reads (a model raising for a second left it at 0 + 0.53 ms an item
        # where it computes 2 + 1.1, and max_batch_size: auto at 1).
        answered = False
        try:
            for i, (call, attempt) in enumerate(
                zip(inflight.calls, inflight.attempts, strict=True)
            ):
                output = await self._settler.settle(call, attempt, replica.start)
                answered = (answered or i == 0) and output is not None
                if i == 0 and output is not None:
                    started_s = output.started_s
                if output is None or output.model_s is None or model_s is None:
                    model_s = None
                else:
                    model_s += output.model_s
            if model_s is not None:
                self.preempts = True  # the model computes in steps on the loop
        finally:
            for attempt in inflight.attempts:
                if inspect.iscoroutine(attempt):
                    attempt.close()  # never started if an earlier group was cancelled
            self._launched.pop(batch.batch_id, None)
            end = self._clock.now()
            replica.last_landed_s = end
            compute_s = max(0.0, end - started_s)
            if busy is not None:
                busy.add(end, compute_s)
            self._telemetry.batch_done(batch, replica.counters, compute_s)
            times = self._batch_times
            if times is not None and answered and batch.unit == times.unit:
                times.observe(batch.units, compute_s, model_s)
            if self.on_landed is not None:
                self.on_landed(batch, end)
            if self._intake.has_lengths:
                groups = [call.requests for call in inflight.calls]
                self._telemetry.tokens(*self._intake.token_slots(groups))
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
            if self._queues.num_live and self.idle:
                self.wake_one()


@dataclass(slots=True)
class _InFlight:
    """A batch handed to a replica: a model call per signature group, and their attempts."""

    batch: Batch
    calls: list[ModelCall]
    attempts: list[Awaitable[RunOutput]]
    launched_s: float
    cancels: Cancels
