"""``carpool.core.preempt``: a queued request wakes and holds only the replicas computing
a batch of a lower class than its own."""

from __future__ import annotations

import asyncio

from carpool.core.clock import MonotonicClock
from carpool.core.preempt import Preemptions
from carpool.core.stepwise import StepGate


async def test_a_request_wakes_only_replicas_computing_a_lower_class() -> None:
    preemptions = Preemptions(MonotonicClock())
    loop = asyncio.get_running_loop()
    gates = {1: StepGate(), 2: StepGate()}
    landings = {rank: loop.create_future() for rank in gates}
    waits = {
        rank: asyncio.ensure_future(
            preemptions.wait(rank, rank, gates[rank], landings[rank], wake_at_s=None)
        )
        for rank in gates
    }
    await asyncio.sleep(0)
    preemptions.note_queued(1)  # a class-1 request: only the class-2 batch is below it
    await asyncio.sleep(0.01)
    assert waits[2].done() and not waits[1].done()
    # The class-2 batch's calls now wait at their next step; class 1 and above do not.
    assert gates[2].most_urgent(2) == 1 and gates[1].most_urgent(1) == 1
    gates[2].release()
    assert gates[2].most_urgent(2) == 2
    landings[1].set_result(None)  # the batch ended: its wait ends too
    await asyncio.wait_for(waits[1], 1.0)


async def test_a_delay_that_runs_out_wakes_the_replica() -> None:
    clock = MonotonicClock()
    preemptions = Preemptions(clock)
    landing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    started = clock.now()
    await asyncio.wait_for(
        preemptions.wait(0, 2, StepGate(), landing, wake_at_s=started + 0.01), 1.0
    )
    assert clock.now() - started >= 0.009 and not landing.done()


async def test_a_delay_that_runs_out_holds_the_gate_at_once() -> None:
    """The lower batch stops at its next step when the higher class's window ends, not
    at the steps it would take while the replica's task gets to run again."""
    clock = MonotonicClock()
    preemptions = Preemptions(clock)
    gate = StepGate()
    gate.enter(2)  # the lower batch's call in progress
    landing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    await asyncio.wait_for(preemptions.wait(0, 2, gate, landing, wake_at_s=clock.now() + 0.01), 1.0)
    assert gate.most_urgent(2) < 2  # the rank-2 call waits at its next step
    gate.release()
    assert gate.most_urgent(2) == 2
