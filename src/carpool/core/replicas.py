"""Where batches run: one replica per copy of the model, each pulling batches when free.

A synchronous model runs on its replica's own thread, so the event loop keeps accepting
requests while a batch computes (NumPy and torch release the GIL in their kernels);
collation and splitting stay on the loop. An ``async`` model runs on the loop.

A replica takes one :class:`ModelCall` at a time (:meth:`Replica.start`): the requests
whose payloads go through the model together, and gives back a :class:`RunOutput`, one
result per request and when the call ran.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from carpool.core.model_call import ModelCall, RunOutput
from carpool.core.stepwise import StepGate, is_steps, run_on_loop, run_to_end
from carpool.core.telemetry import ReplicaCounters
from carpool.core.watchdog import (
    CallWatch,
    ReplicaThread,
    ThreadWatch,
    Watchdog,
    awaited_within,
    is_cancelling,
)
from carpool.errors import ConfigError, StartedLate, Withdrawn

log = logging.getLogger("carpool.replicas")

BatchFn = Callable[[Any], Any]
FnFactory = Callable[[str], BatchFn]


EXECUTORS = ("auto", "thread", "loop", "process", "ray")

# A model's replicas build their copies on their own threads at once, so builds take turns:
# a factory that seeds torch's global RNG (torch.manual_seed, then nn.Linear's
# initialisation) would otherwise interleave its draws with another replica's and build
# other weights than its seed gives; torch.export.load keeps its deserializer in a module
# global and refuses a second concurrent load. The cost is start-up time with several
# devices. A factory that waits for its sibling replicas (a barrier, a process group)
# would wait forever: a build kept waiting is logged every BUILD_WAIT_LOG_S.
BUILD_LOCK = threading.RLock()
BUILD_WAIT_LOG_S = 30.0


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


LONGEST_BATCH_ON_LOOP_S = 0.05
# Batches in a row that took longer than LONGEST_BATCH_ON_LOOP_S without computing that
# long (the model waited, or the host preempted the process) before a replica leaves.
SLOW_BATCHES_TO_LEAVE_LOOP = 3
thread_cpu_s: Callable[[], float] = time.thread_time  # the loop thread's CPU time


def runs_on_loop(executor: str, device: str) -> bool:
    """Whether a sync model on ``device`` starts on the event loop's thread.

    ``"auto"`` means yes only for a CPU model in a process confined to one CPU: there a
    replica thread cannot compute in parallel with the loop, it only takes turns with it
    on the one core, and each turn costs a context switch and the caches the other side
    filled (W1 over HTTP on one core served more requests per second on the loop: see
    ``docs/benchmarks.md``). The loop then waits for each batch, as it would for its turn.
    Under ``"auto"`` a replica whose batch computes longer than
    ``LONGEST_BATCH_ON_LOOP_S`` (in CPU time of the loop's thread) moves to its thread for
    good: the loop must not go deaf to health checks and new connections for that long.
    A batch that took that long in wall time only (the model blocked, or the host ran
    something else) counts towards ``SLOW_BATCHES_TO_LEAVE_LOOP`` in a row: one hiccup of
    a shared machine must not cost the loop's advantage for the rest of the process.
    """
    if executor == "auto":
        return device == "cpu" and usable_cpus() == 1
    return executor == "loop"


def replica_devices(num_replicas: int | None, devices: list[str] | None) -> list[str]:
    """One device string per replica: ``devices``, else ``num_replicas`` (1) CPU ones.

    Raises:
        ConfigError: devices that are not a list of strings, none, a count that disagrees
            with them, or not an int >= 1.
    """
    if devices is not None:
        # A bare "cuda:0" would otherwise read as six replicas on devices "c", "u", ...
        if not isinstance(devices, list | tuple):
            raise ConfigError("devices", devices, 'a list of device strings, as ["cuda:0"]')
        if not devices:
            raise ConfigError("devices", devices, "at least one device string")
        for device in devices:
            if not isinstance(device, str) or not device:
                raise ConfigError("devices[]", device, 'a device string, as "cpu" or "cuda:0"')
        if num_replicas is not None and num_replicas != len(devices):
            raise ConfigError("num_replicas", num_replicas, f"{len(devices)}, one per device")
        return list(devices)
    num_replicas = 1 if num_replicas is None else num_replicas
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError("num_replicas", num_replicas, "an integer >= 1")
    return ["cpu"] * num_replicas


def check_threading(switch_interval_s: float | None, executor: str) -> None:
    """Check a batcher's GIL switch interval and executor.

    Raises:
        ConfigError: naming the argument and what it may be.
    """
    if switch_interval_s is not None and not (
        isinstance(switch_interval_s, int | float)
        and not isinstance(switch_interval_s, bool)
        and 0 < switch_interval_s <= 1
    ):
        raise ConfigError("switch_interval_s", switch_interval_s, "seconds in (0, 1] or None")
    if executor not in EXECUTORS:
        raise ConfigError("executor", executor, f"one of {list(EXECUTORS)}")


async def io_turn() -> None:
    """Let the event loop read its sockets before the next batch is chosen: a model that
    computed on the loop's thread left every request that arrived meanwhile unread."""
    await asyncio.sleep(0)  # the loop polls for I/O after this round of callbacks
    await asyncio.sleep(0)  # and runs the readers (which queue requests) before this


def is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


class SwitchInterval:
    """Shares one lowered GIL switch interval among the batchers that asked for it.

    While a replica thread computes, the event loop answers and admits requests in bursts
    of pure Python. The model thread needs the GIL for a moment between ops; with the
    interpreter's default 5 ms switch interval it may wait out a whole burst, several times
    per batch. The first holder lowers the interval; the last one to leave restores it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved_s: float | None = None

    def hold(self, interval_s: float) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved_s = sys.getswitchinterval()
            self._holders += 1
            if interval_s < sys.getswitchinterval():
                sys.setswitchinterval(interval_s)

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._saved_s is not None:
                sys.setswitchinterval(self._saved_s)
                self._saved_s = None


switch_interval = SwitchInterval()


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA or not), or an OOM RuntimeError."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


async def _raise(exc: Exception) -> RunOutput:
    raise exc


_LATE = object()  # what a replica thread returns for a call it did not run
_WITHDRAWN = object()  # ... for a call it did not run because requests were cancelled


class Replica:
    """One copy of the model. ``idle_since_s`` is set while it waits for a batch.

    A synchronous replica takes up to ``pipeline_depth`` = 2 batches: while one computes,
    the next *full* batch may already wait on its thread, so the thread goes from one to
    the next without a round trip through the event loop. Batches that could still grow
    are never queued this way; they close only when the replica is free. A request of a
    waiting batch that expires or is cancelled meanwhile is still withdrawn: the thread
    asks when the batch's turn comes (:meth:`ModelCall.check_turn`), and skips a call
    that holds one; the loop runs the rest of it again without them.

    With a ``watchdog`` whose ``timeout_s`` is set, a call that runs past it is given up
    (see :mod:`carpool.core.watchdog`): an ``async`` model's call is cancelled; on a
    thread, the call raises :class:`~carpool.errors.Hung`, the calls queued behind
    it :class:`~carpool.errors.Displaced`, and the replica goes on with a fresh
    thread, where a ``factory`` builds its model again first (``is_healthy`` is False
    until that build ends: :meth:`renewed`). A sync model on the event loop's thread
    cannot be watched.
    """

    def __init__(
        self,
        replica_id: int,
        device: str,
        name: str,
        fn: BatchFn | None,
        factory: FnFactory | None,
        now: Callable[[], float],
        executor: str = "auto",
        watchdog: Watchdog | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.device = device
        self.counters = ReplicaCounters(replica_id, device)
        self.idle_since_s: float | None = None
        self.last_landed_s = -math.inf  # when its previous batch was answered
        self._name = name
        self._fn = fn
        self._factory = factory
        self._now = now
        self._watchdog = watchdog
        self._watch = ThreadWatch(watchdog.clock, self._hung) if watchdog is not None else None
        # OpenMP's thread count is per thread: a new thread would use every core even
        # after torch.set_num_threads(1) on the main thread. Carry the setting over.
        torch = sys.modules.get("torch")
        self._torch_threads: int | None = torch.get_num_threads() if torch else None
        self._thread = self._new_thread()
        self._stuck: list[ReplicaThread] = []  # given up, until they end (if ever)
        self._renewal: asyncio.Future[None] | None = None  # the model built again
        self._is_async = fn is not None and is_async_callable(fn)
        self._on_loop = runs_on_loop(executor, device)
        self._may_leave_loop = executor == "auto"
        self._num_slow_batches = 0  # too long in wall time, in a row, on the loop
        # Calls in steps on the loop: a higher class's goes first (policy preempt).
        self.gate = StepGate()

    def _new_thread(self) -> ReplicaThread:
        suffix = self.counters.num_abandoned  # carpool-m-r0_0, then _1 once replaced...
        return ReplicaThread(f"carpool-{self._name}-r{self.replica_id}_{suffix}", self._init_thread)

    def _judge_loop_batch(self, wall_s: float, cpu_s: float) -> None:
        """Under ``auto``: move later batches to the replica's thread after one batch that
        computed too long, or several in a row that took too long (see runs_on_loop)."""
        if wall_s <= LONGEST_BATCH_ON_LOOP_S:
            self._num_slow_batches = 0
            return
        self._num_slow_batches += 1
        if cpu_s > LONGEST_BATCH_ON_LOOP_S or self._num_slow_batches >= SLOW_BATCHES_TO_LEAVE_LOOP:
            self._on_loop = False  # later batches run on the replica's thread

    def _init_thread(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)

    @property
    def is_threaded(self) -> bool:
        """Whether the model runs on this replica's thread (a sync model off the loop)."""
        return not self._is_async and not self._on_loop

    @property
    def blocks_loop(self) -> bool:
        """Whether the model computes on the event loop's thread, holding it meanwhile."""
        return not self._is_async and self._on_loop

    @property
    def pipeline_depth(self) -> int:
        return 2 if self.is_threaded else 1

    @property
    def is_healthy(self) -> bool:
        """False from a hang until its fresh model is built (see :meth:`renewed`)."""
        return self._renewal is None

    @property
    def num_stuck_threads(self) -> int:
        """Threads given up on whose call has not returned yet."""
        self._stuck = [t for t in self._stuck if t.is_alive]
        return len(self._stuck)

    async def load(self) -> None:
        """Build this replica's model with the factory, on the replica's own thread, one
        build at a time (``BUILD_LOCK``)."""
        if self._factory is not None:
            loop = asyncio.get_running_loop()
            self._fn = await loop.run_in_executor(self._thread, self._build)
            self._is_async = is_async_callable(self._fn)

    async def renewed(self) -> None:
        """Wait for the model a hang had built again; afterwards the replica is healthy.

        Raises:
            Exception: what the factory raised (the replica stays unhealthy; :meth:`renew`
                tries again).
        """
        renewal = self._renewal
        if renewal is not None:
            await renewal
            if self._renewal is renewal:
                self._renewal = None

    def renew(self) -> None:
        """Build the model again on the replica's current thread (calls queued after this
        run on the new model); a plain ``fn`` is kept as it is."""
        if self._factory is None:
            return
        loop = asyncio.get_running_loop()
        self._renewal = loop.run_in_executor(self._thread, self._rebuild)

    def _rebuild(self) -> None:
        self._fn = None  # a call queued behind a failed build finds no model
        self._fn = self._build()

    def _hung(self, watch: CallWatch) -> None:
        """A watched call ran past its ``timeout_s``: give up on its thread, go on with a
        fresh one (see :mod:`carpool.core.watchdog`), and wake the call's waiter."""
        if watch.thread is not self._thread or watch.running is None:
            return  # that thread was given up already
        log.error(
            "model %r, replica %d (%s): a batch has run %.3g s, past batch_timeout_s=%g; its "
            "requests fail with BatchTimeout, and the replica goes on with a fresh thread%s. "
            "The stuck thread cannot be stopped: it is counted in /metrics "
            "(carpool_replica_threads_stuck) until its call returns",
            self._name,
            self.replica_id,
            self.device,
            self._now() - watch.started_s,
            watch.timeout_s,
            " and its model built again" if self._factory is not None else "",
        )
        self._leave_thread()
        self.renew()
        watch.running.cancel()

    def _leave_thread(self) -> None:
        """Abandon the current thread (counted) and take a fresh one."""
        old = self._thread
        old.abandon()
        self._stuck.append(old)
        self.counters.num_abandoned += 1
        self._thread = self._new_thread()

    def give_up(self) -> None:
        """Closing without waiting: abandon the thread if a call runs or waits on it, so
        that :meth:`close` does not wait for it."""
        if self._thread.is_busy:
            self._leave_thread()

    def _build(self) -> BatchFn:
        assert self._factory is not None
        waited_s = 0.0
        while not BUILD_LOCK.acquire(timeout=BUILD_WAIT_LOG_S):
            waited_s += BUILD_WAIT_LOG_S
            log.warning(
                "replica %d (%s) has waited %.0f s to build its model: replicas are built "
                "one at a time, and another one's factory has not returned",
                self.replica_id,
                self.device,
                waited_s,
            )
        try:
            return self._factory(self.device)
        finally:
            BUILD_LOCK.release()

    def start(self, call: ModelCall) -> Awaitable[RunOutput]:
        """Begin collate → model → split; the awaitable gives one result per request.

        The call's ``deadline_s`` is checked when the model's turn comes (a call may wait
        behind the replica's previous one): past it the model is not called and the
        awaitable raises :class:`~carpool.errors.StartedLate`. :meth:`ModelCall.is_withdrawn`
        is asked then too: when some of the call's requests were cancelled, the model is
        not called and the awaitable raises :class:`~carpool.errors.Withdrawn`. A call
        given up by the watchdog raises :class:`~carpool.errors.Hung` (or ``Displaced``)."""
        if self._is_async:
            return self._run_async(call)  # awaited in place: it runs on the loop anyway
        # Collation and splitting run on the loop: the replica thread then holds the GIL
        # only to call the model (whose kernels release it), instead of contending with
        # the loop for it over Python-level stacking and slicing.
        try:
            batch = call.collate()
        except Exception as exc:
            return _raise(exc)
        if self._on_loop:
            return self._run_on_loop(call, batch)
        return self._run_threaded(call, batch)

    async def _run_async(self, call: ModelCall) -> RunOutput:
        fn = self._fn
        assert fn is not None, "a replica runs only after load()"
        now = self._now
        started = now()
        call.check_turn(started)
        batch = call.collate()
        timeout_s = self._watchdog.timeout_s if self._watchdog is not None else None
        if timeout_s is None:
            outputs = await fn(batch)
        else:
            assert self._watchdog is not None
            clock = self._watchdog.clock
            outputs = await awaited_within(fn(batch), clock, started, timeout_s, self.replica_id)
        return call.output(outputs, started, now())

    async def _run_on_loop(self, call: ModelCall, batch: Any) -> RunOutput:
        fn = self._fn
        assert fn is not None, "a replica runs only after load()"
        started = self._now()
        call.check_turn(started)
        cpu_started = thread_cpu_s()
        outputs = fn(batch)
        model_s = None
        if is_steps(outputs):  # the loop runs between its steps: judge the longest
            outputs, steps = await run_on_loop(outputs, self.gate, call.rank)
            held_s, held_cpu_s, model_s = steps.longest_s, steps.longest_cpu_s, steps.total_s
        else:
            held_s, held_cpu_s = self._now() - started, thread_cpu_s() - cpu_started
        ended = self._now()
        if self._may_leave_loop:
            self._judge_loop_batch(held_s, held_cpu_s)
        return call.output(outputs, started, ended, model_s)

    def _run_threaded(self, call: ModelCall, batch: Any) -> Awaitable[RunOutput]:
        now = self._now
        deadline_s = call.deadline_s
        timeout_s = self._watchdog.timeout_s if self._watchdog is not None else None
        thread = self._thread
        watch = CallWatch(thread, timeout_s) if timeout_s is not None else None
        watching = self._watch

        # The batch is the job's argument, not in its closure: a failed call's traceback
        # keeps the job's frame, whose function (and so its closure) outlives clearing it,
        # and the batch must be gone before the call's halves run (out of memory).
        def job(batch: Any) -> tuple[Any, float, float]:
            started = now()
            if watch is not None:
                watch.started_s = started
            if deadline_s is not None and started >= deadline_s:
                return _LATE, started, started
            if call.is_withdrawn():  # read on this thread: see Cancels
                return _WITHDRAWN, started, started
            model = self._fn  # read here: a hang has it built again on this thread
            if model is None:
                raise RuntimeError(
                    f"replica {self.replica_id} of model {self._name!r} has no model: "
                    "building it again after a hang failed (see the log)"
                )
            outputs = run_to_end(model(batch))
            return outputs, started, now()

        running = asyncio.get_running_loop().run_in_executor(thread, job, batch)

        async def finish() -> RunOutput:
            if watch is not None:
                assert watching is not None
                watch.running = running
                watching.watch(watch)
            try:
                outputs, started, ended = await running
            except asyncio.CancelledError:
                if watch is not None and watch.thread.is_abandoned and not is_cancelling():
                    raise watch.verdict(now(), self.replica_id) from None
                raise
            finally:
                if watch is not None:
                    assert watching is not None
                    watching.unwatch(watch)
            if outputs is _LATE:
                call.release()
                raise StartedLate(started)
            if outputs is _WITHDRAWN:
                call.release()
                raise Withdrawn(started)
            return call.output(outputs, started, ended)

        return finish()

    def close(self) -> None:
        """End the replica's thread: wait for its calls, unless it was given up; stop
        watching it."""
        if self._watch is not None:
            self._watch.close()
        if not self._thread.is_abandoned:
            self._thread.shutdown(wait=True)


class ReplicaLike(Protocol):
    """What the dispatcher uses of a replica: a :class:`Replica` (thread or loop) or a
    :class:`~carpool.core.process_replica.ProcessReplica`."""

    replica_id: int
    device: str
    counters: ReplicaCounters
    idle_since_s: float | None
    last_landed_s: float

    @property
    def is_threaded(self) -> bool: ...
    @property
    def blocks_loop(self) -> bool: ...
    @property
    def pipeline_depth(self) -> int: ...
    @property
    def is_healthy(self) -> bool: ...
    @property
    def num_stuck_threads(self) -> int: ...
    async def load(self) -> None: ...
    async def renewed(self) -> None: ...
    def renew(self) -> None: ...
    def give_up(self) -> None: ...
    def start(self, call: ModelCall) -> Awaitable[RunOutput]: ...
    def close(self) -> None: ...
