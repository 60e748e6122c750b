"""Adversarial edges of how batches are formed and run, each a bug found in review: a
``submit_many`` request straddling a preferred size, a deadline passing while a batch
waits behind a busy replica, out of memory caused by one request rather than the batch
size, ...

Time is a FakeClock (``conftest.py``); every wait has a short safety timeout, so a hang
shows as a failure, never a stuck run.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from carpool import CapacityError, DeadlineExceeded, ModelError
from carpool.core.clock import settle

SAFETY_S = 5.0  # a net against a hung test, never a timing assertion


async def finish(*tasks: asyncio.Task[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)


class PermitModel:
    """A sync model that needs one permit per call: the test releases calls one by one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.permits = threading.Semaphore(0)
        self.entered: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.calls: list[list[Any]] = []

    def __call__(self, batch: Any) -> Any:
        items = list(batch)
        self.calls.append(items)
        self.loop.call_soon_threadsafe(self.entered.put_nowait, items)
        if not self.permits.acquire(timeout=SAFETY_S):
            raise RuntimeError("test never released the model")
        return [x * 10 for x in items]

    async def next_call(self) -> list[Any]:
        return await asyncio.wait_for(self.entered.get(), SAFETY_S)


@pytest.fixture
async def permit_model() -> Any:
    model = PermitModel(asyncio.get_running_loop())
    yield model
    model.permits.release(100)  # let the replica thread end at teardown


# -- preferred batch sizes -----------------------------------------------------------------


async def test_preferred_size_filled_by_a_prefix_is_sent_when_a_many_request_straddles_a_larger(
    make_batcher, fake_model, fake_clock, spawn
):
    """Preferred (2, 4); requests of 1, 1 and 3 items: no FIFO prefix makes 4, but the
    first two make 2, a preferred size the queue can fill now (Triton sends it). Trimming
    towards 4 used to go past 2 and then give up, so everything waited for the delay."""
    batcher = make_batcher(
        collate="list", max_batch_size=8, max_delay_s=1.0, preferred_batch_sizes=(2, 4)
    )
    tasks = [spawn(batcher.submit(1)), spawn(batcher.submit(2))]
    tasks.append(spawn(batcher.submit_many([3, 4, 5])))
    await settle()
    assert fake_model.sizes == [2]

    await fake_clock.advance(1.0)
    assert fake_model.sizes == [2, 3]
    assert await finish(*tasks) == [10, 20, [30, 40, 50]]


# -- deadlines of a batch waiting behind a busy replica ------------------------------------


async def test_deadline_passing_while_a_batch_waits_behind_a_busy_replica_never_runs_it(
    make_batcher, permit_model, fake_clock, spawn
):
    """A sync replica queues a full batch behind the one it computes. A request in that
    batch whose deadline passes before its turn must get DeadlineExceeded and never reach
    the model; its batch-mates still run."""
    batcher = make_batcher(fn=permit_model, collate="list", max_batch_size=2, max_delay_s=10.0)
    first = [spawn(batcher.submit(i)) for i in (0, 1)]
    assert await permit_model.next_call() == [0, 1]
    second = [spawn(batcher.submit(i)) for i in (2, 3)]
    late = spawn(batcher.submit(4, timeout_s=1.0))
    mate = spawn(batcher.submit(5))
    await settle()
    permit_model.permits.release()  # [0, 1] ends; [2, 3] runs, [4, 5] queues behind it
    assert await permit_model.next_call() == [2, 3]
    await settle()
    assert batcher.num_pending == 0

    await fake_clock.advance(2.0)  # request 4's deadline passes while [2, 3] computes
    permit_model.permits.release(3)
    results = await finish(*first, *second, late, mate)

    assert results[:4] == [0, 10, 20, 30]
    assert isinstance(results[4], DeadlineExceeded)
    assert results[5] == 50
    assert [4] not in permit_model.calls and all(4 not in c for c in permit_model.calls)
    assert batcher.snapshot().classes["normal"].rejections["deadline"] == 1


# -- out of memory -------------------------------------------------------------------------


async def test_one_item_out_of_memory_alone_fails_it_without_capping_every_batch_at_one(
    make_batcher, fake_model, spawn
):
    """A batch of one item cannot get any smaller: the request gets CapacityError, and
    nothing was learnt about batch sizes, so later batches keep their full size."""
    batcher = make_batcher(max_batch_size=8, max_delay_s=0.0)
    fake_model.fail_if = lambda items: MemoryError("huge input") if 99 in items else None
    (outcome,) = await finish(spawn(batcher.submit(99)))
    assert isinstance(outcome, CapacityError)
    assert batcher.effective_max_batch_size == 8


async def test_one_oversized_request_does_not_drag_the_oom_cap_down_to_one(
    make_batcher, fake_model, fake_clock, spawn
):
    """A batch of 8 runs out of memory because of one request. Bisection isolates it
    (it fails with CapacityError, the other 7 succeed in batches of up to 4); the cap is
    half the failed batch, not 1 because every half holding that request failed too."""
    batcher = make_batcher(max_batch_size=8, max_delay_s=1.0)
    fake_model.fail_if = lambda items: MemoryError("huge input") if 99 in items else None
    tasks = [spawn(batcher.submit(99))] + [spawn(batcher.submit(i)) for i in range(1, 8)]
    await settle()
    outcomes = await finish(*tasks)
    assert isinstance(outcomes[0], CapacityError)
    assert outcomes[1:] == [i * 10 for i in range(1, 8)]
    assert batcher.effective_max_batch_size == 4


# -- model outputs of the wrong shape ------------------------------------------------------


@pytest.mark.parametrize("empty", [{}, ()], ids=["dict", "tuple"])
async def test_model_returning_an_empty_dict_or_tuple_is_a_model_error(make_batcher, spawn, empty):
    """No outputs at all is the wrong number of outputs: each caller used to get an empty
    {} or () as if it were its result."""

    async def fn(batch: Any) -> Any:
        return empty

    batcher = make_batcher(fn=fn, collate="packed", max_batch_size=4, max_delay_s=0.0)
    await batcher.start()
    outcomes = await finish(spawn(batcher.submit(np.ones(3))), spawn(batcher.submit(np.ones(2))))
    assert all(isinstance(o, ModelError) for o in outcomes), outcomes
    assert "returned 0 outputs" in str(outcomes[0])
