"""What replicas whose model lives in another process share: process replicas
(:mod:`carpool.core.process_replica`) and Ray actor replicas
(:mod:`carpool.core.ray_replica`).

Such a process can die under a call: the call raises
:class:`~carpool.errors.ReplicaDied` and runs once more on a sibling replica that is up
(else its requests fail with a ``ModelError`` saying so). The replica then starts its
process again by itself (its ``_restarter`` task) and takes no batch until that is done
(:meth:`RemoteReplica.renewed`). A call is awaited within ``batch_timeout_s``; past it the
replica ends its process (:meth:`RemoteReplica._hung`) and the call raises ``Hung``.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from carpool.core.model_call import ModelCall, RunOutput
from carpool.core.telemetry import ReplicaCounters
from carpool.core.watchdog import Watchdog, awaited_within
from carpool.errors import Hung, ReplicaDied

log = logging.getLogger("carpool.replicas")

RESTART_WAIT_S = 0.1
RESTART_WAIT_MAX_S = 5.0


class ChildState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"  # to be started again
    CLOSED = "closed"


class RemoteReplica(abc.ABC):
    """The part of a process or Ray replica that does not depend on which it is. A
    subclass runs a call in its process (:meth:`_run_here`) and ends a hung one
    (:meth:`_hung`)."""

    pipeline_depth = 1
    is_threaded = False
    blocks_loop = False
    num_stuck_threads = 0

    def __init__(
        self,
        replica_id: int,
        device: str,
        name: str,
        now: Callable[[], float],
        watchdog: Watchdog | None,
        group: Sequence[RemoteReplica],
    ) -> None:
        self.replica_id = replica_id
        self.device = device
        self.counters = ReplicaCounters(replica_id, device)
        self.idle_since_s: float | None = None
        self.last_landed_s = -math.inf
        self._name = name
        self._now = now
        self._watchdog = watchdog
        self._group = group
        self._state = ChildState.STARTING
        self._lock = asyncio.Lock()  # one call at a time on the process
        self._restarter: asyncio.Task[None] | None = None
        self._restart_wait_s = RESTART_WAIT_S

    @property
    def is_healthy(self) -> bool:
        """Whether its process is up, with its model built."""
        return self._state is ChildState.READY

    async def renewed(self) -> None:
        """Wait while the process is being started again."""
        restarter = self._restarter
        while restarter is not None and not restarter.done():
            await asyncio.shield(restarter)
            restarter = self._restarter

    def renew(self) -> None:  # noqa: B027 (a no-op by design, not a hook to override)
        """Nothing to do: a dead process is started again by the replica itself."""

    def start(self, call: ModelCall) -> Awaitable[RunOutput]:
        """Run ``call`` in the process; the awaitable gives one result per request, or
        raises as a thread replica's would, or ReplicaDied."""
        return self._run(call, may_retry=True)

    async def _run(self, call: ModelCall, may_retry: bool) -> RunOutput:
        try:
            return await self._run_here(call)
        except ReplicaDied:
            if not may_retry:
                raise
            other = next((r for r in self._group if r is not self and r.is_healthy), None)
            if other is None:
                raise
            log.warning(
                "model %r: the batch of replica %d runs again on replica %d",
                self._name,
                self.replica_id,
                other.replica_id,
            )
            return await other._run(call, may_retry=False)

    @abc.abstractmethod
    async def _run_here(self, call: ModelCall) -> RunOutput:
        """Run ``call`` in this replica's process (raises ReplicaDied if it dies, or is not
        up). It never waits for a restart: the dispatcher waits for one (:meth:`renewed`)
        before it hands the replica a batch, and a batch retried on a sibling must not wait
        for a process or a Ray node that may not come back."""

    async def _within_timeout(self, pending: Awaitable[Any], started_s: float) -> Any:
        """``await pending``, the call started at ``started_s``; past ``batch_timeout_s``
        the process is ended (:meth:`_hung`) and Hung raised."""
        timeout_s = self._watchdog.timeout_s if self._watchdog is not None else None
        if timeout_s is None:
            return await pending
        assert self._watchdog is not None
        clock = self._watchdog.clock
        try:
            return await awaited_within(pending, clock, started_s, timeout_s, self.replica_id)
        except Hung:
            self._hung(started_s, timeout_s)
            raise

    @abc.abstractmethod
    def _hung(self, started_s: float, timeout_s: float) -> None:
        """End the process of a call started at ``started_s`` that ran past ``timeout_s``."""
