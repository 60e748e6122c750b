"""A batch that runs past ``batch_timeout_s``: its requests fail with BatchTimeout, its
replica goes on with a fresh thread (and a fresh model from its factory), and the requests
behind it are served. Time is a FakeClock: the watchdog fires when the test advances it."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, settle
from carpool.core.dispatch import RENEW_WAIT_S
from carpool.core.watchdog import ReplicaThread
from carpool.errors import BatchTimeout

from .conftest import SAFETY_S, until

HANG = 99  # the input the fake models hang on
TIMEOUT_S = 0.2


class HangsOnOne:
    """A sync model: doubles its items, but blocks on ``release`` when it gets HANG.
    Each call announces (items, thread name) on ``entered``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.release = threading.Event()
        self.entered: asyncio.Queue[tuple[list[int], str]] = asyncio.Queue()
        self.num_returned_from_hang = 0

    def __call__(self, batch: list[int]) -> list[int]:
        items = list(batch)
        self.loop.call_soon_threadsafe(
            self.entered.put_nowait, (items, threading.current_thread().name)
        )
        if HANG in items:
            self.release.wait(SAFETY_S)
            self.num_returned_from_hang += 1
        return [2 * x for x in items]

    async def wait_entered(self) -> tuple[list[int], str]:
        return await asyncio.wait_for(self.entered.get(), SAFETY_S)


@pytest.fixture
async def hangs(fake_clock: FakeClock) -> AsyncIterator[HangsOnOne]:
    model = HangsOnOne(asyncio.get_running_loop())
    yield model
    model.release.set()


@pytest.fixture
async def make(fake_clock: FakeClock) -> AsyncIterator[Callable[..., Batcher]]:
    """``make(fn=..., fn_factory=..., **policy)``: a threaded batcher on the fake clock,
    with batch_timeout_s=TIMEOUT_S unless given; each is cut off at teardown."""
    made: list[Batcher] = []

    def build(fn: Any = None, *, fn_factory: Any = None, **policy: Any) -> Batcher:
        policy.setdefault("batch_timeout_s", TIMEOUT_S)
        batcher = Batcher(
            fn,
            BatchPolicy(**policy),
            fn_factory=fn_factory,
            clock=fake_clock,
            executor="thread",
            switch_interval_s=None,
            name="hanger",
        )
        made.append(batcher)
        return batcher

    yield build
    for batcher in made:
        batcher.cut_off()  # a thread still in the model is left behind, not waited for
        await asyncio.wait_for(batcher.stop(), SAFETY_S)


async def _results(*tasks: asyncio.Task[Any]) -> list[Any]:
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)
    return list(done)


async def test_a_hung_batch_fails_its_requests_and_later_ones_run_on_a_fresh_thread(
    make, hangs, fake_clock, loop_errors
):
    batcher = make(hangs, max_batch_size=3, max_delay_s=10.0)
    stuck = [asyncio.ensure_future(batcher.submit(x)) for x in (1, HANG, 3)]
    items, first_thread = await hangs.wait_entered()
    assert items == [1, HANG, 3]

    await fake_clock.advance(TIMEOUT_S)

    outcomes = await _results(*stuck)
    assert all(isinstance(o, BatchTimeout) for o in outcomes), outcomes
    error = outcomes[0]
    assert (error.model, error.batch_timeout_s, error.replica_id) == ("hanger", TIMEOUT_S, 0)
    assert "batch_timeout_s=0.2" in str(error)

    later = [asyncio.ensure_future(batcher.submit(x)) for x in (4, 5, 6)]
    items, fresh_thread = await hangs.wait_entered()
    assert items == [4, 5, 6]
    assert fresh_thread != first_thread
    assert await _results(*later) == [8, 10, 12]

    replica = batcher.snapshot().replicas[0]
    assert (replica.num_abandoned, replica.num_stuck_threads) == (1, 1)
    snapshot = batcher.snapshot().classes["normal"]
    assert (snapshot.num_failed, snapshot.num_completed) == (3, 3)

    hangs.release.set()  # the stuck call returns at last: its result goes nowhere
    await until(lambda: batcher.snapshot().replicas[0].num_stuck_threads == 0)
    assert hangs.num_returned_from_hang == 1
    assert [await batcher.submit_many([7, 8, 9])] == [[14, 16, 18]]
    assert loop_errors == []


async def test_a_batch_queued_behind_a_hung_one_runs_again_on_the_fresh_thread(
    make, hangs, fake_clock
):
    batcher = make(hangs, max_batch_size=2, max_delay_s=10.0)
    await batcher.start()
    hung = [asyncio.ensure_future(batcher.submit(x)) for x in (HANG, 1)]
    behind = [asyncio.ensure_future(batcher.submit(x)) for x in (2, 3)]
    assert (await hangs.wait_entered())[0] == [HANG, 1]
    # The second full batch waits on the replica's thread, behind the hung one.
    assert batcher.num_pending == 0

    await fake_clock.advance(TIMEOUT_S)

    assert all(isinstance(o, BatchTimeout) for o in await _results(*hung))
    assert await _results(*behind) == [4, 6]
    items, thread_name = await hangs.wait_entered()
    assert items == [2, 3] and thread_name.endswith("_1")  # on the fresh thread


async def test_without_batch_timeout_a_long_batch_is_waited_for(make, hangs, fake_clock):
    batcher = make(hangs, max_batch_size=1, batch_timeout_s=None)
    task = asyncio.ensure_future(batcher.submit(HANG))
    await hangs.wait_entered()

    await fake_clock.advance(3600.0)
    assert not task.done()

    hangs.release.set()
    assert await _results(task) == [2 * HANG]
    assert batcher.snapshot().replicas[0].num_abandoned == 0


async def test_a_factory_builds_the_model_again_and_readiness_waits_for_it(make, hangs, fake_clock):
    devices: list[str] = []
    second_build = threading.Event()

    def factory(device: str) -> HangsOnOne:
        devices.append(device)
        if len(devices) == 2:
            second_build.wait(SAFETY_S)
        return hangs

    batcher = make(fn_factory=factory, max_batch_size=1)
    await batcher.start()
    assert batcher.is_ready and devices == ["cpu"]
    task = asyncio.ensure_future(batcher.submit(HANG))
    await hangs.wait_entered()

    await fake_clock.advance(TIMEOUT_S)

    assert isinstance((await _results(task))[0], BatchTimeout)
    await until(lambda: len(devices) == 2)
    assert not batcher.is_ready  # its only replica waits for its fresh model
    later = asyncio.ensure_future(batcher.submit(5))
    await settle()
    assert not later.done()

    second_build.set()
    assert await _results(later) == [10]
    assert batcher.is_ready
    assert devices == ["cpu", "cpu"]


async def test_a_factory_that_fails_to_build_again_is_tried_again(make, hangs, fake_clock, caplog):
    num_builds = 0

    def factory(device: str) -> HangsOnOne:
        nonlocal num_builds
        num_builds += 1
        if num_builds == 2:
            raise RuntimeError("the device is gone")
        return hangs

    batcher = make(fn_factory=factory, max_batch_size=1)
    task = asyncio.ensure_future(batcher.submit(HANG))
    await hangs.wait_entered()
    await fake_clock.advance(TIMEOUT_S)
    assert isinstance((await _results(task))[0], BatchTimeout)
    await until(lambda: "building its model again after a hang failed" in caplog.text)
    assert not batcher.is_ready

    await fake_clock.advance(RENEW_WAIT_S)

    await until(lambda: batcher.is_ready)
    assert num_builds == 3
    assert await batcher.submit(4) == 8


async def test_an_async_model_past_batch_timeout_is_cancelled(make, fake_clock):
    cancelled: list[list[int]] = []
    entered = asyncio.Event()

    async def model(batch: list[int]) -> list[int]:
        if HANG in batch:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(list(batch))
                raise
        return [2 * x for x in batch]

    batcher = make(model, max_batch_size=2, max_delay_s=10.0)
    hung = [asyncio.ensure_future(batcher.submit(x)) for x in (HANG, 1)]
    await asyncio.wait_for(entered.wait(), SAFETY_S)

    await fake_clock.advance(TIMEOUT_S)

    assert all(isinstance(o, BatchTimeout) for o in await _results(*hung))
    assert cancelled == [[HANG, 1]]
    assert await batcher.submit_many([2, 3]) == [4, 6]
    assert batcher.snapshot().replicas[0].num_abandoned == 0  # no thread was left behind


@pytest.mark.parametrize("later_timeout_s", [5.0, TIMEOUT_S / 2])
async def test_a_policy_update_changes_the_timeout_of_later_batches(
    make, hangs, fake_clock, later_timeout_s
):
    batcher = make(hangs, max_batch_size=1)
    assert await batcher.submit(1) == 2  # a batch under the first limit
    batcher.update_policy(batch_timeout_s=later_timeout_s)
    task = asyncio.ensure_future(batcher.submit(HANG))
    await hangs.wait_entered()
    await hangs.wait_entered()

    await fake_clock.advance(min(TIMEOUT_S, later_timeout_s) * 0.9)
    assert not task.done()
    await fake_clock.advance(later_timeout_s)

    assert isinstance((await _results(task))[0], BatchTimeout)
    assert task.exception().batch_timeout_s == later_timeout_s


def test_an_abandoned_thread_cancels_what_waits_on_it_and_takes_no_more() -> None:
    thread = ReplicaThread("carpool-test")
    release = threading.Event()
    running = thread.submit(release.wait, SAFETY_S)
    queued = thread.submit(lambda: 1)
    assert thread.is_busy

    thread.abandon()

    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(lambda: 2)
    release.set()
    assert running.result(SAFETY_S) is True
    thread.shutdown(wait=True)
    assert not thread.is_alive


class _Doubler:
    """A model object the test can hold weakly."""

    def __call__(self, batch: list[int]) -> list[int]:
        return [2 * x for x in batch]


async def test_a_stopped_batcher_lets_go_of_its_models_at_once() -> None:
    """The watchdog's timer, armed for ``batch_timeout_s`` at a replica's first batch, is
    cancelled when its replica closes. Before, the event loop held the timer, the timer
    the replica, the replica its model, for the watchdog's whole minute: ``carpool tune``
    rebuilds a batcher per trial, and every model it built stayed in memory."""
    built: list[weakref.ref[_Doubler]] = []

    def factory(device: str) -> _Doubler:
        model = _Doubler()
        built.append(weakref.ref(model))
        return model

    batcher = Batcher(
        None,
        BatchPolicy(batch_timeout_s=60.0),
        fn_factory=factory,
        executor="thread",
        num_replicas=2,
        name="released",
    )
    async with batcher:
        assert await asyncio.gather(batcher.submit(1), batcher.submit(2)) == [2, 4]
    del batcher
    gc.collect()
    assert len(built) == 2 and [ref() for ref in built] == [None, None]
