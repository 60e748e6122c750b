"""Replicas as Ray actors (``executor="ray"``), placed by Ray on any node of its cluster.

A :class:`RayReplica` has the interface of a
:class:`~carpool.core.process_replica.ProcessReplica`: the batcher, its queues and the
pull-based dispatch stay in this process, and the replica is one more place a batch runs.
Its actor (:class:`ReplicaActor`) builds the model from the source a process replica
builds it from (a picklable function, a factory, or a ``"module:attr"`` string naming
one), on the node Ray chose for the model's ``ray_resources``. Each collated batch is the
argument of one actor call: Ray puts a large one in its object store (and ships it to the
actor's node when that is another), where the actor reads NumPy arrays without a copy;
the outputs come back the same way, and are awaited on the event loop (an ``ObjectRef``
is awaitable), so the loop never blocks on a batch.

Death: a call whose actor dies (``ray.kill``, a crash, its node lost) raises
:class:`~carpool.errors.ActorDied` with what Ray said; the call is tried once on another
live replica, else its requests fail with a ``ModelError`` saying so. The replica then
waits for its actor to come back: Ray restarts it (``max_restarts``) or, once Ray has
given up, carpool creates a new one; either way the replica's ``num_restarts`` counts it
(``carpool_replica_restarts_total``). An actor that dies while it has no batch is found
by the replica asking it, every :data:`HEALTH_CHECK_S` while it idles, where it runs (Ray
Serve checks its replicas' health the same way): the model reads not ready from then, and
a restart Ray made meanwhile is counted then. A call that runs past ``batch_timeout_s`` fails
with ``BatchTimeout`` and its actor is killed and comes back the same way. A model that
raises fails only that call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from carpool.core.model_call import ModelCall, RunOutput
from carpool.core.model_source import ModelSource, build_from_source, process_source
from carpool.core.ray_cluster import (
    DEFAULT_MAX_RESTARTS,
    RayOptions,
    check_max_restarts,
    check_ray_resources,
    ensure_connected,
    import_ray,
)
from carpool.core.ray_placement import (
    PlacementGroup,
    RayPlacement,
    bundle_of,
    check_ray_placement,
)
from carpool.core.remote_replica import (
    RESTART_WAIT_MAX_S,
    RESTART_WAIT_S,
    ChildState,
    RemoteReplica,
)
from carpool.core.replicas import BatchFn, FnFactory
from carpool.core.stepwise import run_to_end
from carpool.core.watchdog import Watchdog
from carpool.errors import ActorDied, ConfigError

log = logging.getLogger("carpool.replicas")

PLACEMENT_WAIT_LOG_S = 30.0  # a start still waiting for Ray to place it is logged this often
HEALTH_CHECK_S = 1.0  # an idle actor is asked where it runs this often
HEALTH_TIMEOUT_S = 10.0  # an answer later than this says nothing (a busy node), not a death


class ReplicaActor:
    """What runs in a replica's Ray actor: the model, built once, run on each batch.

    ``sys_path`` is this server's import path: the folders of it that exist on the actor's
    node and are not on its path yet go at the end, so a ``module:attr`` source found next
    to the config here is found there too (on one machine, as a process replica finds it)."""

    def __init__(self, source: ModelSource, device: str, sys_path: list[str]) -> None:
        for folder in sys_path:
            if folder not in sys.path and os.path.isdir(folder):
                sys.path.append(folder)
        self._refused: ConfigError | None = None
        try:
            self._fn: BatchFn = build_from_source(source, device)
        except ConfigError as exc:
            # Ray would say only that the actor died building it: where() raises it,
            # so that the replica's start fails naming the model's key.
            self._refused = exc
        self._where = (str(import_ray().get_runtime_context().get_node_id()), os.getpid())

    def where(self) -> tuple[str, int]:
        """The node id and process id this actor runs in.

        Raises:
            ConfigError: the model's source refused to build it here.
        """
        if self._refused is not None:
            raise self._refused
        return self._where

    def run(self, batch: Any) -> tuple[tuple[str, int], Any]:
        """Where it runs (a restart Ray made while the replica had no batch shows in it)
        and the model's outputs."""
        return self._where, run_to_end(self._fn(batch))


class RayReplica(RemoteReplica):
    """One copy of the model in a Ray actor (see the module docstring). ``group`` lists
    the model's Ray replicas: a call whose actor died runs again on another;
    ``placement`` their placement group, if the model reserves one (its bundle
    ``replica_id`` holds this replica's actor)."""

    def __init__(
        self,
        replica_id: int,
        device: str,
        name: str,
        source: ModelSource,
        now: Callable[[], float],
        watchdog: Watchdog | None,
        options: RayOptions,
        group: list[RayReplica],
        placement: PlacementGroup | None = None,
    ) -> None:
        super().__init__(replica_id, device, name, now, watchdog, group)
        self.node_id: str | None = None  # where its actor runs, once it does
        self.pid: int | None = None
        self._source = source
        self._options = options
        self._placement = placement
        self._actor: Any = None
        self._reason = "it was not started"  # why it is not READY, for ActorDied
        self._watcher: asyncio.Task[None] | None = None

    @property
    def actor(self) -> Any:
        """Its Ray actor handle (None while there is none)."""
        return self._actor

    async def load(self) -> None:
        """Connect to Ray if nothing did, create the actor and wait for its model.

        Raises:
            ConfigError: Ray is not installed, or the model's source refused to build
                it in the actor (a factory that raised).
            RuntimeError: the model failed to build in the actor otherwise.
        """
        ensure_connected()
        await self._create()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Ask the actor where it runs every :data:`HEALTH_CHECK_S` while it has no
        batch: a death (``kill -9`` of its process) shows now, not as the next batch's
        failure, and a restart Ray made behind it is counted."""
        ray = import_ray()
        while self._state is not ChildState.CLOSED:
            await asyncio.sleep(HEALTH_CHECK_S)
            actor = self._actor
            if self._state is not ChildState.READY or actor is None or self._lock.locked():
                continue  # starting again, or a batch will say
            try:
                where = await asyncio.wait_for(actor.where.remote(), HEALTH_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                if self._actor is actor:
                    self._died(_first_line(exc))
                continue
            except TimeoutError:
                continue
            moved = tuple(where) != (self.node_id, self.pid)
            if moved and self._actor is actor and self._state is ChildState.READY:
                self._restarted_unseen(*where)

    async def _create(self) -> None:
        ray = import_ray()
        options = self._options.actor_options()
        if self._placement is not None:
            # Its bundle holds what it takes: Ray's default of a CPU must not be asked for.
            options.setdefault("num_cpus", 0)
            options["scheduling_strategy"] = await self._placement.reserved(self.replica_id)
        actor_cls = ray.remote(ReplicaActor).options(name=None, **options)
        self._actor = actor_cls.remote(self._source, self.device, list(sys.path))
        self._state = ChildState.STARTING
        try:
            self.node_id, self.pid = await self._placed(self._actor.where.remote())
        except ray.exceptions.RayTaskError as exc:
            self._discard()
            if isinstance(exc.cause, ConfigError):
                raise exc.cause from None  # carpool serve names the key and exits 2
            raise RuntimeError(
                f"model {self._name!r}, replica {self.replica_id}: its Ray actor could not "
                f"say where it runs: {exc}"
            ) from None
        except ray.exceptions.RayActorError as exc:
            self._discard()
            raise RuntimeError(
                f"model {self._name!r}, replica {self.replica_id}: its Ray actor did not "
                f"start (building the model there failed, or Ray could not place it): {exc}"
            ) from None
        except BaseException:
            self._discard()
            raise
        self._state = ChildState.READY

    async def _placed(self, ref: Any) -> tuple[str, int]:
        """``await ref``, saying in the log while Ray has not placed the actor yet."""
        waiting = asyncio.ensure_future(ref)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=PLACEMENT_WAIT_LOG_S)
            if done:
                node_id, pid = waiting.result()
                return node_id, pid
            log.warning(
                "model %r, replica %d: its Ray actor is not up after %g s more; it needs "
                "ray_resources %s (the cluster has %s)",
                self._name,
                self.replica_id,
                PLACEMENT_WAIT_LOG_S,
                self._options.resources,
                import_ray().cluster_resources(),
            )

    def _discard(self) -> None:
        """Kill the actor for good (a failed start, a stop) and forget it."""
        actor, self._actor = self._actor, None
        if actor is not None:
            try:
                import_ray().kill(actor, no_restart=True)
            except Exception:  # already gone, or Ray shut down
                log.debug("killing the Ray actor of replica %d failed", self.replica_id)
        if self._state is not ChildState.CLOSED:
            self._state = ChildState.DEAD

    def _died(self, reason: str) -> None:
        """Its actor died (or was killed after a hang): wait for it to come back."""
        if self._state in (ChildState.DEAD, ChildState.CLOSED):
            return
        self._state = ChildState.DEAD
        self._reason = reason
        log.error(
            "model %r, replica %d: its Ray actor (pid %s on node %s) died (%s); waiting for "
            "it to be started again",
            self._name,
            self.replica_id,
            self.pid,
            self.node_id,
            reason,
        )
        if self._restarter is None or self._restarter.done():
            self._restarter = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        """Wait for Ray to restart the actor (``max_restarts``); once Ray gave up on it,
        create a new one. Each actor that comes back in another process counts one
        restart (one that was only unreachable for a while counts none)."""
        ray = import_ray()
        while self._state is ChildState.DEAD:
            await asyncio.sleep(self._restart_wait_s)
            self._restart_wait_s = min(2 * self._restart_wait_s, RESTART_WAIT_MAX_S)
            if self._state is not ChildState.DEAD:
                return
            was = (self.node_id, self.pid)
            try:
                if self._actor is not None:
                    self.node_id, self.pid = await self._placed(self._actor.where.remote())
                    self._state = ChildState.READY
                else:
                    await self._create()
            except ray.exceptions.ActorDiedError:
                self._actor = None  # Ray gave up on it: the next turn creates another
                continue
            except ray.exceptions.ActorUnavailableError:
                continue  # Ray is restarting it
            except Exception:
                log.exception(
                    "model %r, replica %d: starting its Ray actor again failed; trying again",
                    self._name,
                    self.replica_id,
                )
                continue
            if (self.node_id, self.pid) != was:
                self.counters.num_restarts += 1
            self._restart_wait_s = RESTART_WAIT_S  # up again: the next death waits the least
            log.warning(
                "model %r, replica %d: its Ray actor is up again (pid %s on node %s)",
                self._name,
                self.replica_id,
                self.pid,
                self.node_id,
            )

    async def _run_here(self, call: ModelCall) -> RunOutput:
        ray = import_ray()
        async with self._lock:
            if self._state is not ChildState.READY or self._actor is None:
                raise ActorDied(self._name, self.replica_id, self._reason, self._where())
            now = self._now
            started = now()
            call.check_turn(started)
            ref = self._actor.run.remote(call.collate())
            try:
                where, outputs = await self._within_timeout(ref, started)
            except ray.exceptions.RayActorError as exc:
                reason = _first_line(exc)
                where = self._where()
                self._died(reason)
                raise ActorDied(self._name, self.replica_id, reason, where) from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause
                raise cause if isinstance(cause, Exception) else RuntimeError(str(exc)) from None
            if where != (self.node_id, self.pid):  # Ray restarted it while it had no batch
                self._restarted_unseen(*where)
            self._restart_wait_s = RESTART_WAIT_S
            return call.output(outputs, started, now())

    def _where(self) -> str:
        return f"pid {self.pid} on node {self.node_id}"

    def _restarted_unseen(self, node_id: str, pid: int) -> None:
        log.warning(
            "model %r, replica %d: its Ray actor (pid %s) was restarted by Ray while it ran "
            "no batch; it runs as pid %s on node %s now",
            self._name,
            self.replica_id,
            self.pid,
            pid,
            node_id,
        )
        self.node_id, self.pid = node_id, pid
        self.counters.num_restarts += 1

    def _hung(self, started_s: float, timeout_s: float) -> None:
        """Kill the actor now: the next batch must not reach it. Ray restarts it (if
        ``max_restarts`` allows; else carpool creates another)."""
        log.error(
            "model %r, replica %d: a batch has run %.3g s, past batch_timeout_s=%s; its "
            "requests fail with BatchTimeout, and its Ray actor (pid %s) is killed",
            self._name,
            self.replica_id,
            self._now() - started_s,
            timeout_s,
            self.pid,
        )
        actor = self._actor
        if actor is not None:
            try:
                import_ray().kill(actor, no_restart=False)
            except Exception:
                self._actor = None  # gone already: create another
        self._died(f"killed after a batch ran past batch_timeout_s={timeout_s}")

    def give_up(self) -> None:
        """Closing without waiting: the same as :meth:`close` (killing an actor does not
        wait for it)."""
        self.close()

    def close(self) -> None:
        """Kill the actor (and stop waiting for it to come back)."""
        if self._state is ChildState.CLOSED:
            return
        self._state = ChildState.CLOSED
        for task in (self._restarter, self._watcher):
            if task is not None and not task.get_loop().is_closed():
                task.cancel()
        self._discard()
        if self._placement is not None:
            self._placement.release(self.replica_id)


def _first_line(exc: BaseException) -> str:
    """What Ray said, without its multi-line details: its cause when it gives one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = next((line for line in lines if line.startswith("The actor is dead because")), None)
    return cause or (lines[0] if lines else type(exc).__name__)


def ray_replicas(
    name: str,
    devices: Sequence[str],
    source: ModelSource,
    now: Callable[[], float],
    options: RayOptions,
    watchdog: Watchdog | None,
    placement: RayPlacement | None = None,
) -> list[RayReplica]:
    """One Ray replica per device, each knowing its siblings (and, with ``placement``,
    their placement group of one bundle of ``options.resources`` each)."""
    reserved = (
        PlacementGroup(name, placement, [bundle_of(options.resources)] * len(devices))
        if placement is not None
        else None
    )
    group: list[RayReplica] = []
    for i, device in enumerate(devices):
        group.append(RayReplica(i, device, name, source, now, watchdog, options, group, reserved))
    return group


def ray_replica_maker(
    executor: str,
    name: str,
    devices: Sequence[str],
    fn: BatchFn | None,
    fn_factory: FnFactory | str | None,
    ray_resources: object,
    max_restarts: object,
    ray_placement: object = None,
) -> Callable[[Watchdog], list[RayReplica]] | None:
    """What makes a batcher's Ray replicas, given its watchdog; None unless ``executor``
    is ``"ray"``.

    Raises:
        ConfigError: Ray options for another executor, options that are not valid, a
            model that cannot reach an actor, or Ray not installed.
    """
    if executor != "ray":
        for key, value in (
            ("ray_resources", ray_resources),
            ("max_restarts", max_restarts),
            ("ray_placement", ray_placement),
        ):
            if value is not None:
                raise ConfigError(key, value, "None unless executor='ray'")
        return None
    options = RayOptions(
        check_ray_resources(ray_resources),
        DEFAULT_MAX_RESTARTS if max_restarts is None else check_max_restarts(max_restarts),
    )
    placement = check_ray_placement(ray_placement)
    if placement is not None:
        bundle_of(options.resources)  # not empty: say so now
    source = process_source(fn, fn_factory, executor)
    import_ray()  # installed: say so now, not when the batcher starts

    def make(watchdog: Watchdog) -> list[RayReplica]:
        now = watchdog.clock.now
        return ray_replicas(name, devices, source, now, options, watchdog, placement)

    return make
