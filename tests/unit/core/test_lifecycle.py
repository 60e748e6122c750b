"""A batcher's lifecycle (``carpool.core.lifecycle``): stopping within a bound
(``stop(timeout_s=...)`` and ``cut_off()`` answer what a drain has not finished in time
with Closed, and leave a stuck replica thread behind), a stop whose caller gave up, and one
batcher used from several event loops, one after another or at once."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

import carpool
from carpool import Batcher, BatchPolicy, Closed
from carpool.core.clock import FakeClock, settle
from carpool.errors import ConfigError

from .conftest import SAFETY_S, finish, until


class Stuck:
    """A sync model that blocks until ``release`` (at most SAFETY_S), then doubles."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, batch: list[int]) -> list[int]:
        self.entered.set()
        self.release.wait(SAFETY_S)
        return [2 * x for x in batch]


def _batcher(model: Any, clock: FakeClock) -> Batcher:
    policy = BatchPolicy(max_batch_size=2, max_delay_s=0.0, batch_timeout_s=None)
    return Batcher(model, policy, clock=clock, executor="thread", switch_interval_s=None)


# -- start and stop ---------------------------------------------------------------------------


async def test_context_manager_drains_every_accepted_request(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=10.0)
    async with batcher:
        assert batcher.is_running
        tasks = [spawn(batcher.submit(i)) for i in range(3)]
        await settle()
        assert fake_model.batches == []

    assert not batcher.is_running
    assert await finish(*tasks) == [0, 10, 20]
    assert fake_clock.now() == 1000.0  # answered without the delay expiring


async def test_stop_without_drain_fails_queued_requests_with_closed(
    make_batcher, fake_model, spawn
):
    batcher = make_batcher(max_delay_s=10.0)
    tasks = [spawn(batcher.submit(i)) for i in range(3)]
    await settle()

    await batcher.stop(drain=False)

    outcomes = await finish(*tasks)
    assert all(isinstance(o, Closed) for o in outcomes)
    assert fake_model.batches == []
    assert batcher.snapshot().classes["normal"].rejections == {"closed": 3}


@pytest.mark.parametrize("drain", [True, False])
async def test_submit_after_stop_raises_closed(make_batcher, drain):
    batcher = make_batcher()
    await batcher.start()
    await batcher.stop(drain=drain)
    with pytest.raises(Closed):
        await batcher.submit(1)


async def test_a_submit_waiting_on_a_start_that_is_then_stopped_is_refused(make_batcher, spawn):
    """A submit that waits on another caller's start() resumes after that caller has
    stopped the batcher: it is refused (Closed), not queued where nothing would run it."""
    batcher = make_batcher()

    async def start_then_stop() -> None:
        await batcher.start()
        await batcher.stop(drain=True)

    stopper = spawn(start_then_stop())
    await asyncio.sleep(0)  # the stopper is inside start()
    submitter = spawn(batcher.submit(1))
    await finish(stopper)
    (outcome,) = await finish(submitter)
    assert isinstance(outcome, Closed)
    assert batcher.num_pending == 0


async def test_first_submit_starts_the_batcher(make_batcher):
    batcher = make_batcher(max_delay_s=0.0)
    assert not batcher.is_running
    assert await batcher.submit(2) == 20
    assert batcher.is_running


async def test_stop_leaves_no_tasks_or_threads_behind(make_batcher, sync_model, spawn):
    sync_model.gate.set()
    threads_before = set(threading.enumerate())
    tasks_before = asyncio.all_tasks()
    batcher = make_batcher(fn=sync_model, num_replicas=2, max_delay_s=0.0, max_batch_size=1)

    await batcher.start()
    assert await finish(*(spawn(batcher.submit(i)) for i in range(4))) == [0, 10, 20, 30]
    assert any(t.name.startswith("carpool-") for t in threading.enumerate())
    assert len(asyncio.all_tasks() - tasks_before) == 2
    await batcher.stop()

    assert set(threading.enumerate()) == threads_before
    assert asyncio.all_tasks() == tasks_before


async def test_start_is_idempotent(make_batcher):
    batcher = make_batcher(num_replicas=2)
    tasks_before = asyncio.all_tasks()
    await batcher.start()
    await batcher.start()
    await asyncio.gather(batcher.start(), batcher.start())

    new_tasks = asyncio.all_tasks() - tasks_before
    assert len(new_tasks) == 2
    assert batcher.snapshot().replicas[1].replica_id == 1
    assert len(batcher.snapshot().replicas) == 2


async def test_restarts_after_stop(make_batcher):
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    assert await batcher.submit(1) == 10
    await batcher.stop()
    await batcher.start()

    assert batcher.is_running
    assert await batcher.submit(2) == 20


async def test_a_drain_past_its_timeout_cuts_off_what_is_left_with_closed(
    fake_clock: FakeClock,
) -> None:
    model = Stuck()
    batcher = _batcher(model, fake_clock)
    try:
        running = asyncio.ensure_future(batcher.submit(1))
        await until(model.entered.is_set)
        queued = [asyncio.ensure_future(batcher.submit(x)) for x in (2, 3)]
        await settle()
        stopping = asyncio.ensure_future(batcher.stop(drain=True, timeout_s=1.0))
        await fake_clock.advance(0.5)
        assert not stopping.done()

        await fake_clock.advance(0.5)

        await asyncio.wait_for(stopping, SAFETY_S)
        outcomes = await asyncio.gather(running, *queued, return_exceptions=True)
        assert all(isinstance(o, Closed) for o in outcomes), outcomes
        snapshot = batcher.snapshot()
        assert snapshot.classes["normal"].rejections["closed"] == 3
        assert snapshot.replicas[0].num_abandoned == 1  # left behind, not waited for
        assert not batcher.is_running
    finally:
        model.release.set()


async def test_a_drain_within_its_timeout_answers_everything(fake_clock: FakeClock) -> None:
    model = Stuck()
    batcher = _batcher(model, fake_clock)
    running = asyncio.ensure_future(batcher.submit(1))
    await until(model.entered.is_set)
    stopping = asyncio.ensure_future(batcher.stop(drain=True, timeout_s=1.0))
    model.release.set()

    await asyncio.wait_for(stopping, SAFETY_S)

    assert await running == 2
    assert batcher.snapshot().replicas[0].num_abandoned == 0
    assert batcher.cut_off() == 0  # stopped: nothing left to cut off


async def test_cut_off_says_how_many_requests_it_failed(fake_clock: FakeClock) -> None:
    model = Stuck()
    batcher = _batcher(model, fake_clock)
    try:
        tasks = [asyncio.ensure_future(batcher.submit(1))]
        await until(model.entered.is_set)
        tasks += [asyncio.ensure_future(batcher.submit(x)) for x in (2, 3, 4)]
        await settle()

        assert batcher.cut_off() == 4

        await asyncio.wait_for(batcher.stop(), SAFETY_S)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, Closed) for o in outcomes)
        with pytest.raises(Closed):
            await batcher.submit(5)
    finally:
        model.release.set()


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), "1"])
async def test_stop_refuses_a_timeout_that_is_not_seconds(value: object) -> None:
    batcher = Batcher(lambda batch: batch, BatchPolicy())
    with pytest.raises(ConfigError, match="timeout_s"):
        await batcher.stop(timeout_s=value)  # type: ignore[arg-type]


async def test_cancelled_stop_still_answers_every_accepted_request(make_batcher, fake_model, spawn):
    """``await asyncio.wait_for(batcher.stop(), t)`` that times out must not cancel the
    running batch and leave every queued caller waiting forever."""
    batcher = make_batcher(max_batch_size=1, max_delay_s=0.0)
    await batcher.start()
    fake_model.hold()
    calls = [spawn(batcher.submit(i)) for i in (1, 2, 3)]
    await settle()
    assert fake_model.running == 1

    stopper = spawn(batcher.stop(drain=True))
    await settle()
    stopper.cancel()  # the caller of stop() gave up waiting
    await settle()
    fake_model.release()

    results = await asyncio.wait_for(asyncio.gather(*calls), SAFETY_S)
    assert results == [10, 20, 30]
    await asyncio.wait_for(batcher.stop(), SAFETY_S)
    assert not batcher.is_running
    with pytest.raises(Closed):
        await batcher.submit(4)


async def test_stop_during_start_leaves_the_batcher_stopped(make_batcher, fake_model, spawn):
    building, built = threading.Event(), threading.Event()

    def build(device: str) -> Any:
        building.set()
        built.wait(SAFETY_S)
        return fake_model

    batcher = make_batcher(fn_factory=build, max_delay_s=0.0)
    starting = spawn(batcher.start())
    await until(building.is_set)
    assert not starting.done()  # start() waits for the model its factory is building

    stopping = spawn(batcher.stop())
    await settle()  # stop() now waits for the start in progress
    built.set()
    await finish(starting, stopping)

    assert not batcher.is_running
    with pytest.raises(Exception, match="not accepting requests"):
        await batcher.submit(1)


# -- one decorated function, several event loops ---------------------------------------------


def _close_abandoned(loop: asyncio.AbstractEventLoop) -> None:
    """Close ``loop`` as a bare ``loop.close()`` does (pending tasks left as they are),
    then drop those tasks now, so that their destruction is logged inside this test."""
    loop.close()
    gc.collect()


def test_loop_closed_without_cancelling_its_tasks_does_not_break_the_next_call():
    """``loop.run_until_complete(f(x)); loop.close()`` (older pytest-asyncio fixtures do
    this) left the idle replica's waiter on the closed loop: the next asyncio.run(f(y))
    raised 'Event loop is closed' instead of restarting the batcher lazily."""

    @carpool.batched(max_batch_size=4, max_delay_s=0.0)
    async def double(batch: list[int]) -> list[int]:
        return [x * 2 for x in batch]

    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(asyncio.wait_for(double(1), SAFETY_S)) == 2
    _close_abandoned(loop)

    assert asyncio.run(asyncio.wait_for(double(2), SAFETY_S)) == 4
    asyncio.run(asyncio.wait_for(double.stop(), SAFETY_S))


def test_lazily_started_function_serves_a_second_event_loop():
    """``asyncio.run(f(x))`` twice: the first call started the batcher lazily on a loop
    that is now closed. The second call must be served (or refused with a clear error),
    not raise 'attached to a different loop' and leave its request queued forever."""

    @carpool.batched(max_batch_size=4, max_delay_s=0.0)
    async def double(batch: list[int]) -> list[int]:
        return [x * 2 for x in batch]

    assert asyncio.run(asyncio.wait_for(double(1), SAFETY_S)) == 2
    try:
        assert asyncio.run(asyncio.wait_for(double(2), SAFETY_S)) == 4
    finally:
        assert double.batcher.num_pending == 0


async def test_cancelling_one_lazy_first_caller_does_not_cancel_another():
    """Two first calls race into the lazy start; the caller that gave up is cancelled,
    the other is not and must get its result."""

    @carpool.batched(max_batch_size=4, max_delay_s=0.0)
    async def double(batch: list[int]) -> list[int]:
        return [x * 2 for x in batch]

    first = asyncio.ensure_future(double(1))
    second = asyncio.ensure_future(double(2))
    await asyncio.sleep(0)  # both are inside start(): the first loads, the second waits
    first.cancel()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(first, second, return_exceptions=True), SAFETY_S
        )
        assert isinstance(results[0], asyncio.CancelledError)
        assert not second.cancelled(), "a caller nobody cancelled was cancelled"
        assert results[1] == 4
    finally:
        await asyncio.wait_for(double.stop(drain=False), SAFETY_S)


def test_batch_cut_off_by_its_closed_loop_does_not_hold_its_class_share():
    """A batch of a class with a replica share, running when its loop was closed, never
    landed: its class still counted a replica as taken, and on the next loop that class
    never got one again (its requests waited forever)."""
    entered = asyncio.Event()  # bound to the first loop that waits on it

    @carpool.batched(max_batch_size=1, max_delay_s=0.0)
    async def model(batch: list[str]) -> list[str]:
        if batch[0] == "stuck":
            entered.set()
            await asyncio.Future()  # never answered: the loop is closed under it
        return batch

    loop = asyncio.new_event_loop()
    stuck = loop.create_task(model("stuck", priority="background"))  # share=0.5
    loop.run_until_complete(asyncio.wait_for(entered.wait(), SAFETY_S))
    stuck.cancel()  # its caller gives up; the batch still runs
    loop.run_until_complete(asyncio.sleep(0))
    _close_abandoned(loop)

    assert asyncio.run(asyncio.wait_for(model("x", priority="background"), SAFETY_S)) == "x"
    asyncio.run(asyncio.wait_for(model.stop(), SAFETY_S))


def test_context_manager_on_a_new_loop_after_a_lazy_start_on_an_ended_one():
    """asyncio.run(f(x)) started f lazily; a later ``async with f:`` on a new loop must
    start it there and drain it on exit (its stop() gathered the dead loop's tasks and
    raised 'Event loop is closed')."""

    @carpool.batched(max_batch_size=4, max_delay_s=0.0)
    async def double(batch: list[int]) -> list[int]:
        return [x * 2 for x in batch]

    async def open_and_close() -> None:
        async with double:
            pass

    async def serve(x: int) -> int:
        async with double:
            return await double(x)

    assert asyncio.run(asyncio.wait_for(double(1), SAFETY_S)) == 2
    asyncio.run(asyncio.wait_for(open_and_close(), SAFETY_S))
    assert not double.batcher.is_running
    assert asyncio.run(asyncio.wait_for(serve(2), SAFETY_S)) == 4


def test_batcher_started_on_an_ended_loop_stops_from_a_new_one():
    batcher = Batcher(lambda batch: batch)

    async def submit() -> Any:
        await batcher.start()
        return await batcher.submit(1)

    assert asyncio.run(asyncio.wait_for(submit(), SAFETY_S)) == 1
    asyncio.run(asyncio.wait_for(batcher.stop(), SAFETY_S))
    assert not batcher.is_running


def test_call_from_a_second_running_loop_is_refused_before_it_is_queued():
    """A loop in another thread owns the batcher: a call from this thread's loop got
    asyncio's 'attached to a different loop' after its request was queued, from the
    wrong thread, where the owner's replicas were never woken to run it."""

    @carpool.batched(max_batch_size=4, max_delay_s=0.0)
    async def double(batch: list[int]) -> list[int]:
        return [x * 2 for x in batch]

    started, done = threading.Event(), threading.Event()
    results: list[int] = []

    async def owner() -> None:
        async with double:
            results.append(await double(1))
            started.set()
            await asyncio.to_thread(done.wait, SAFETY_S)
            results.append(await double(3))

    thread = threading.Thread(target=asyncio.run, args=(owner(),))
    thread.start()
    try:
        assert started.wait(SAFETY_S)
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(asyncio.wait_for(double(2), SAFETY_S))
        assert double.batcher.num_pending == 0
    finally:
        done.set()
        thread.join(SAFETY_S)
    assert results == [2, 6]
    assert double.snapshot().classes["normal"].num_requests == 2


def test_a_call_from_another_loop_while_the_first_loop_starts_it_is_refused_as_such():
    """While a loop in another thread is starting the batcher, a call from this thread's
    loop awaited that start's future and got asyncio's 'attached to a different loop'
    instead of the batcher's own error."""
    building, built = threading.Event(), threading.Event()

    def build(device: str) -> Any:
        building.set()
        built.wait(SAFETY_S)
        return lambda batch: [x * 2 for x in batch]

    batcher = Batcher(
        None, BatchPolicy(max_batch_size=4, max_delay_s=0.0), fn_factory=build, collate="list"
    )
    results: list[int] = []

    async def owner() -> None:
        async with batcher:
            results.append(await batcher.submit(1))

    thread = threading.Thread(target=asyncio.run, args=(owner(),))
    thread.start()
    try:
        assert building.wait(SAFETY_S)
        for call in (batcher.submit(2), batcher.start(), batcher.stop()):
            with pytest.raises(RuntimeError, match="runs on another event loop"):
                asyncio.run(asyncio.wait_for(call, SAFETY_S))
    finally:
        built.set()
        thread.join(SAFETY_S)
    assert results == [2]
