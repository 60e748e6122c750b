"""Where a batcher's batches run (``carpool.core.dispatch``), driven through the Batcher:
each replica's loop pulls a batch when it is free, a busy sync replica queues only a full
batch behind the one it computes, idle replicas wake for work that ages past a class's cap,
a drain ends every loop, and a loop survives callbacks that raise.

Time is a FakeClock (``conftest.py``); sync models are released by the test, and every
wait has a short safety timeout, so a hang shows as a failure, never a stuck run.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from carpool import Batcher, BatchPolicy, ClassPolicy, DeadlineExceeded, ModelError
from carpool.core.clock import settle

from .conftest import SAFETY_S, finish

# -- replicas pull batches when free ----------------------------------------------------------


async def test_sync_model_runs_off_the_loop_and_batches_grow_while_it_is_busy(
    make_batcher, sync_model, spawn
):
    batcher = make_batcher(fn=sync_model, max_batch_size=16, max_delay_s=0.0)
    first = spawn(batcher.submit(0))
    items, thread_name = await sync_model.wait_entered()
    assert items == [0]
    assert thread_name.startswith("carpool-")
    assert thread_name != threading.current_thread().name

    queued = [spawn(batcher.submit(i)) for i in range(1, 6)]
    await settle()
    assert batcher.num_pending == 5  # accepted while the model is blocked
    assert not any(t.done() for t in (first, *queued))

    sync_model.gate.set()
    assert await finish(first, *queued) == [0, 10, 20, 30, 40, 50]
    assert sync_model.sizes == [1, 5]


async def test_two_replicas_run_batches_at_once(make_batcher, sync_model, spawn):
    batcher = make_batcher(fn=sync_model, num_replicas=2, max_batch_size=2, max_delay_s=0.0)
    first = spawn(batcher.submit(0))
    _, thread_a = await sync_model.wait_entered()
    second = spawn(batcher.submit(1))
    _, thread_b = await sync_model.wait_entered()
    assert thread_a != thread_b  # both replicas busy at once

    queued = [spawn(batcher.submit(i)) for i in range(2, 8)]
    await settle()
    assert batcher.num_pending == 6
    sync_model.gate.set()
    assert await finish(first, second, *queued) == [i * 10 for i in range(8)]

    snap = batcher.snapshot()
    assert all(r.num_batches >= 1 for r in snap.replicas)
    assert sum(r.num_items for r in snap.replicas) == 8
    assert snap.batches.size_histogram == {1: 2, 2: 3}


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


async def test_busy_sync_replica_queues_only_a_full_batch_behind_the_running_one(
    make_batcher, spawn
):
    model = PermitModel(asyncio.get_running_loop())
    batcher = make_batcher(fn=model, collate="list", max_batch_size=2, max_delay_s=10.0)
    first = spawn(batcher.submit(0))
    await settle()
    assert batcher.num_pending == 1  # alone, it waits for its delay
    second = spawn(batcher.submit(1))  # now full: it runs
    assert await asyncio.wait_for(model.entered.get(), 5.0) == [0, 1]
    rest = [spawn(batcher.submit(i)) for i in range(2, 7)]
    await settle()
    assert batcher.num_pending == 5  # the replica is busy: nothing closes meanwhile

    model.permits.release()  # [0, 1] finishes
    assert await asyncio.wait_for(model.entered.get(), 5.0) == [2, 3]
    await settle()
    # [4, 5] is full, so it already waits on the replica's thread; [6] could still grow
    # and stays queued until the replica is free.
    assert batcher.num_pending == 1

    model.permits.release(3)
    assert await asyncio.wait_for(model.entered.get(), 5.0) == [4, 5]
    assert await finish(first, second, *rest[:4]) == [0, 10, 20, 30, 40, 50]
    assert not rest[4].done()


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


async def test_every_sync_replica_works_while_one_queues_a_full_batch(
    make_batcher, sync_model, spawn
):
    batcher = make_batcher(sync_model, num_replicas=2, max_batch_size=2, max_delay_s=10.0)
    await batcher.start()
    await settle()

    tasks = [spawn(batcher.submit(i)) for i in range(6)]
    await settle()
    # One replica runs [0, 1] and queues the full [2, 3] behind it; that queued batch
    # occupies no second replica, so the other one must take [4, 5] now.
    assert batcher.num_pending == 0

    sync_model.gate.set()
    assert await finish(*tasks) == [0, 10, 20, 30, 40, 50]


async def test_batch_queued_behind_another_class_keeps_its_share_cap(
    make_batcher, sync_model, spawn
):
    classes = (ClassPolicy("interactive"), ClassPolicy("background", share=0.5))
    batcher = make_batcher(
        sync_model,
        num_replicas=2,
        max_batch_size=2,
        max_delay_s=10.0,
        classes=classes,
        default_class="interactive",
    )
    await batcher.start()
    await settle()
    running_bg = [spawn(batcher.submit(i, priority="background")) for i in (0, 1)]
    await settle()
    assert batcher.num_pending == 0  # background leads its one allowed replica

    interactive = [spawn(batcher.submit(i, priority="interactive")) for i in (2, 3)]
    waiting_bg = [spawn(batcher.submit(i, priority="background")) for i in (4, 5)]
    await settle()
    # The other replica takes the interactive batch. Queuing [4, 5] behind it would
    # put background on both replicas once it runs: share=0.5 forbids that.
    assert batcher.num_pending == 2

    sync_model.gate.set()
    results = await finish(*running_bg, *interactive, *waiting_bg)
    assert results == [0, 10, 20, 30, 40, 50]


# -- a drain ends every replica loop ------------------------------------------------------------


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


# -- which idle replica takes a batch ----------------------------------------------------------


async def test_idle_replicas_of_mixed_speeds_end_up_about_as_busy(make_batcher, fake_clock, spawn):
    """A fast and a slow replica (10 and 20 ms a batch), one request every 15 ms: both
    are often idle when one arrives. Waking the longest-idle replica made them alternate,
    one batch each, so the fast one computed half as long as the slow one; the replica
    least busy lately takes it now, and the fast one runs about twice as many batches."""
    batch_s = {"fast": 0.010, "slow": 0.020}
    ran = dict.fromkeys(batch_s, 0)

    def factory(device: str) -> Any:
        async def model(batch: list[int]) -> list[int]:
            done = asyncio.get_running_loop().create_future()
            fake_clock.call_at(fake_clock.now() + batch_s[device], lambda: done.set_result(None))
            await done
            ran[device] += 1
            return batch

        return model

    batcher = make_batcher(
        fn_factory=factory, devices=["fast", "slow"], max_batch_size=1, max_delay_s=0.0
    )
    await asyncio.wait_for(batcher.start(), SAFETY_S)
    answers = []
    for i in range(200):  # 3 s: a few times the decay's time constant
        answers.append(spawn(batcher.submit(i)))
        await fake_clock.advance(0.015)
    await fake_clock.advance(0.1)
    assert await finish(*answers) == list(range(200))

    assert ran["fast"] + ran["slow"] == 200
    busy_fast, busy_slow = (ran[d] * batch_s[d] for d in ("fast", "slow"))
    assert busy_fast >= 0.9 * busy_slow, ran  # was 0.5: 100 batches each
    assert busy_fast <= 1.1 * busy_slow, ran


# -- idle replicas wake for aged work --------------------------------------------------------


async def test_idle_replica_runs_an_aged_batch_of_a_capped_class(
    make_batcher, fake_model, fake_clock, spawn
):
    classes = (ClassPolicy("normal"), ClassPolicy("background", share=0.5, max_wait_s=1.0))
    batcher = make_batcher(num_replicas=2, max_delay_s=0.01, classes=classes)
    await batcher.start()
    fake_model.hold()
    first = spawn(batcher.submit(1, priority="background"))
    await fake_clock.advance(0.01)
    assert fake_model.running == 1
    second = spawn(batcher.submit(2, priority="background"))
    await fake_clock.advance(0.5)
    assert fake_model.running == 1, "background may lead one batch on two replicas"

    # Past max_wait_s the request is aged, which lifts the cap: the idle replica must
    # wake up for it without waiting for another arrival or for the running batch.
    await fake_clock.advance(1.0)
    assert fake_model.running == 2

    fake_model.release()
    assert await finish(first, second) == [10, 20]


async def test_idle_replicas_share_one_timer_for_a_request_waiting_for_company(
    make_batcher, fake_model, fake_clock, spawn
):
    """Three replicas go idle while one request waits out its delay: one timer wakes one
    of them for it. Each armed its own before; with the least busy woken first, the
    others' timers fired every delay, for nothing, as long as they stayed idle."""
    batcher = make_batcher(num_replicas=3, max_batch_size=2, max_delay_s=1.0)
    await batcher.start()
    fake_model.hold()
    running = [spawn(batcher.submit(i)) for i in range(6)]
    await fake_clock.advance(0.0)
    assert fake_model.running == 3
    lone = spawn(batcher.submit(6))
    await fake_clock.advance(0.1)
    fake_model.release()
    await fake_clock.advance(0.0)
    assert fake_model.running == 0
    assert fake_clock.num_pending_timers == 1  # was 3: one per idle replica

    await fake_clock.advance(0.9)
    assert await finish(*running, lone) == [i * 10 for i in range(7)]
    assert fake_model.sizes == [2, 2, 2, 1]


async def test_one_replica_woken_by_a_request_leaves_no_timer_behind(
    make_batcher, fake_model, fake_clock, spawn
):
    """One replica waits with a timer for a lone request's delay; a second request fills
    the batch first. Its timer goes with the wait: a shared one, never cancelled, stayed
    armed and woke the replica once more for nothing."""
    batcher = make_batcher(num_replicas=1, max_batch_size=2, max_delay_s=1.0)
    await batcher.start()
    fake_model.hold()
    first = spawn(batcher.submit(0))
    await fake_clock.advance(0.1)
    assert fake_model.running == 0
    assert fake_clock.num_pending_timers == 1  # the delay of the lone request
    delay_s = fake_clock.next_timer_s()
    second = spawn(batcher.submit(1))
    await fake_clock.advance(0.0)
    assert fake_model.running == 1
    # The running batch's watchdog (batch_timeout_s), and no other: the shared timer
    # stayed armed for the lone request's delay.
    assert fake_clock.num_pending_timers == 1
    assert fake_clock.next_timer_s() != delay_s

    fake_model.release()
    assert await finish(first, second) == [0, 10]
    assert fake_model.sizes == [2]


async def test_a_failed_batch_is_not_fitted_as_the_models_time_for_its_size() -> None:
    """Was: every landed batch's span was fitted, a failed one's too (its bisection, or an
    exception at once), and a model raising for a second left the adaptive line at no
    overhead and max_batch_size: auto at 1 item."""
    failing = True

    def model(batch: list[int]) -> list[int]:
        if failing:
            raise ValueError("not now")
        return [x * 2 for x in batch]

    policy = BatchPolicy(max_delay_s="auto", max_batch_size="auto", slo_s=0.05)
    async with Batcher(model, policy, collate="list", switch_interval_s=None) as batcher:
        for _ in range(3):
            results = await asyncio.gather(
                *(batcher.submit(i) for i in range(4)), return_exceptions=True
            )
            assert all(isinstance(r, ModelError) for r in results)
        state = batcher.adaptive_state()
        assert state is not None and state.num_batches == 0
        failing = False
        for _ in range(2):  # a size's first batch is a warm-up, never fitted
            assert await asyncio.wait_for(batcher.submit(3), SAFETY_S) == 6
        state = batcher.adaptive_state()
        assert state is not None and state.num_batches == 1
