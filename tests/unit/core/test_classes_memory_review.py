"""Regression tests for bugs found in review of priority classes, out-of-memory recovery,
replicas and the packed layout.

Each test names the behaviour that was broken; the fixtures come from ``conftest.py``
(a FakeClock, an async ``FakeModel``, a thread-blocking ``BlockingSyncModel``).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import numpy as np

from carpool import CapacityError, ClassPolicy, DeadlineExceeded
from carpool.core.clock import settle

SAFETY_S = 5.0  # a net against a hung test, never a timing assertion


async def finish(*tasks: asyncio.Task[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)


# -- priority classes --------------------------------------------------------------------


async def test_aged_lower_class_does_not_starve_an_older_higher_class_request(
    make_batcher, fake_model, fake_clock, spawn
):
    # Aging exists so that no class starves. An aged "normal" request goes before every
    # *younger* request, but an "interactive" request that has waited even longer must
    # not be passed over: under a sustained normal backlog every normal head is aged, and
    # interactive (which never ages) would otherwise never run again.
    classes = (ClassPolicy("interactive"), ClassPolicy("normal", max_wait_s=1.0))
    batcher = make_batcher(
        max_batch_size=1, max_delay_s=0.0, classes=classes, fill_from_lower=False
    )
    await batcher.start()
    fake_model.hold()
    blocker = spawn(batcher.submit(0, priority="normal"))
    await settle()
    assert fake_model.running == 1  # the one replica is busy from now on

    interactive = spawn(batcher.submit(1, priority="interactive"))
    await fake_clock.advance(0.5)
    backlog = [spawn(batcher.submit(i, priority="normal")) for i in (2, 3)]
    await fake_clock.advance(1.5)  # the normal backlog is aged; interactive is older still

    fake_model.release()
    await finish(blocker, interactive, *backlog)
    order = [batch[0] for batch in fake_model.batches]
    assert order == [0, 1, 2, 3]


# -- replicas and draining ---------------------------------------------------------------


async def test_drain_returns_when_the_work_an_idle_replica_waited_for_is_cancelled(
    make_batcher, fake_model, spawn
):
    # Background may lead a batch on one of the two replicas at a time. While draining,
    # the other replica finds only capped background work and waits. That work is then
    # cancelled; when the running batch lands nothing is left, and the waiting replica
    # must still be told to end, or stop() never returns.
    classes = (ClassPolicy("normal"), ClassPolicy("background", share=0.5))
    batcher = make_batcher(num_replicas=2, max_batch_size=1, max_delay_s=10.0, classes=classes)
    await batcher.start()
    fake_model.hold()
    running = spawn(batcher.submit(0, priority="background"))
    queued = spawn(batcher.submit(1, priority="background"))
    await settle()
    assert fake_model.running == 1 and batcher.num_pending == 1
    stopping = spawn(batcher.stop(drain=True))
    await settle()
    queued.cancel()
    await settle()
    fake_model.release()
    assert await finish(running) == [0]
    await asyncio.wait_for(stopping, SAFETY_S)
    assert fake_model.batches == [[0]]


async def test_drain_returns_when_the_work_an_idle_replica_waited_for_expires(
    make_batcher, fake_model, fake_clock, spawn
):
    classes = (ClassPolicy("normal"), ClassPolicy("background", share=0.5))
    batcher = make_batcher(num_replicas=2, max_batch_size=1, max_delay_s=10.0, classes=classes)
    await batcher.start()
    fake_model.hold()
    running = spawn(batcher.submit(0, priority="background"))
    queued = spawn(batcher.submit(1, priority="background", timeout_s=1.0))
    await settle()
    stopping = spawn(batcher.stop(drain=True))
    await fake_clock.advance(1.0)
    fake_model.release()
    results = await finish(running, queued)
    assert results[0] == 0 and isinstance(results[1], DeadlineExceeded)
    await asyncio.wait_for(stopping, SAFETY_S)


# -- out of memory -----------------------------------------------------------------------


class _Device:
    """A fake accelerator memory of ``budget`` units: an allocation is freed only when the
    last reference to it goes (as a CUDA tensor's memory is)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.in_use = 0

    def allocate(self) -> _Block:
        if self.in_use + 1 > self.budget:
            raise MemoryError(f"{self.in_use} of {self.budget} units in use")
        return _Block(self)


class _Block:
    def __init__(self, device: _Device) -> None:
        self.device = device
        device.in_use += 1

    def __del__(self) -> None:
        self.device.in_use -= 1


async def test_oom_halves_run_after_the_failed_batch_memory_is_freed(make_batcher, spawn):
    # The failed call's activations live in the frames of the exception's traceback.
    # Retrying the halves while that exception is still held (inside the except block)
    # keeps them allocated, so halves that fit fail too and every request gets
    # CapacityError (PyTorch's FAQ: recover from OOM outside the except clause).
    device = _Device(budget=3)

    async def model(batch: Any) -> Any:
        activations = []  # a local of the model's frame, as a forward pass's tensors are
        for _ in batch:
            activations.append(device.allocate())  # one unit per item
        return [x * 10 for x in batch]

    batcher = make_batcher(model, max_batch_size=4, max_delay_s=10.0)
    await batcher.start()
    tasks = [spawn(batcher.submit(i)) for i in range(4)]
    results = await finish(*tasks)
    assert results == [0, 10, 20, 30]
    assert device.in_use == 0


async def test_oom_halves_of_a_threaded_model_run_after_the_failed_batch_is_freed(
    make_batcher, spawn
):
    device = _Device(budget=3)

    def model(batch: Any) -> Any:
        activations = []
        for _ in batch:
            activations.append(device.allocate())
        return [x * 10 for x in batch]

    batcher = make_batcher(model, max_batch_size=4, max_delay_s=10.0, collate="list")
    await batcher.start()
    tasks = [spawn(batcher.submit(i)) for i in range(4)]
    results = await finish(*tasks)
    assert results == [0, 10, 20, 30]
    assert not any(isinstance(r, CapacityError) for r in results)


# -- queues: lazy deletion -----------------------------------------------------------------


async def test_cancelled_requests_do_not_pile_up_behind_a_waiting_head(
    make_batcher, fake_model, spawn
):
    # A queue bound caps the *live* requests; cancelled ones are only marked and stay
    # in the deque (with their payloads) until the head moves. A head that waits long
    # (a long delay, a capped class) must not let clients that give up and retry grow
    # the queue's memory without bound.
    payloads: list[weakref.ref[np.ndarray]] = []
    batcher = make_batcher(max_batch_size=8, max_delay_s=100.0, max_queue_size=2)
    await batcher.start()
    head = spawn(batcher.submit(np.zeros(4)))
    await settle()
    for _ in range(200):
        payload = np.zeros((1, 4))
        payloads.append(weakref.ref(payload))
        request = batcher.enqueue_many(payload)
        batcher.cancel(request)
        del payload, request
    assert batcher.num_pending == 1
    retained = sum(ref() is not None for ref in payloads)
    assert retained <= 64, f"{retained} payloads of cancelled requests are still held"
    await batcher.stop(drain=True)
    assert (await finish(head))[0].shape == (4,)
