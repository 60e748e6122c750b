"""Which replicas a request of a higher class may preempt, and waking them when one comes.

A replica that computes a batch in steps on the event loop under a policy with
``preempt`` (see :mod:`carpool.core.dispatch`) waits here, while its batch runs, for a
request of a class above that batch's lead class: :meth:`Preemptions.note_queued` holds
the replica's :class:`~carpool.core.stepwise.StepGate` for that class (the lower batch
stops at its next step) and wakes the replica's loop to form the higher batch.
"""

from __future__ import annotations

import asyncio
import functools

from carpool.core.clock import Clock
from carpool.core.idle import wake
from carpool.core.stepwise import StepGate


class Preemptions:
    """The replicas waiting for a higher class, by replica id: the rank of the batch each
    computes, the future that wakes its loop, and its step gate."""

    __slots__ = ("_clock", "_waiting")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._waiting: dict[int, tuple[int, asyncio.Future[None], StepGate]] = {}

    def note_queued(self, rank: int) -> None:
        """A request of class ``rank`` was queued: hold the gate of each replica computing
        a batch of a lower class, and wake its loop."""
        for lead_rank, woken, gate in self._waiting.values():
            if rank < lead_rank:
                gate.hold(rank)  # the lower batch stops at its next step from now
                wake(woken)

    async def wait(
        self,
        replica_id: int,
        rank: int,
        gate: StepGate,
        landing: asyncio.Future[None],
        wake_at_s: float | None,
    ) -> None:
        """Until ``landing`` is done, a request of a class above ``rank`` is queued, or
        ``wake_at_s`` (a higher class's delay runs out). Then the gate is held, as
        :meth:`note_queued` holds it, so that the lower batch stops at its next step: the
        loop takes a few turns to run this replica's task again, and a model in steps on
        the loop would take a step at each (a 5 ms window came due four steps late)."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[replica_id] = (rank, woken, gate)
        timer = None
        if wake_at_s is not None:
            timer = self._clock.call_at(wake_at_s, functools.partial(_due, gate, rank, woken))
        try:
            await asyncio.wait((landing, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            del self._waiting[replica_id]
            if timer is not None:
                timer.cancel()


def _due(gate: StepGate, rank: int, woken: asyncio.Future[None]) -> None:
    """A higher class's delay ran out: calls of ``rank`` wait from their next step."""
    gate.hold(rank - 1)
    wake(woken)
