"""The in-process API as a user writes it, reviewed: each test failed before its fix.

A decorator keyword of the wrong shape, errors that could not be pickled or copied, a
stop() whose caller gave up, and one decorated function used from several event loops
(a loop closed without cancelling its tasks, ``async with`` on a new loop, a loop still
running in another thread).

Bounded: every wait has a short safety timeout, so a hang shows as a failure.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import pickle
import threading
from typing import Any

import pytest

import carpool
from carpool import (
    Batcher,
    CapacityError,
    CarpoolError,
    ClassPolicy,
    Closed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelError,
    QueueFull,
)
from carpool.core.clock import settle

SAFETY_S = 2.0  # a net against a hung test, never a timing assertion


# -- decorator keywords --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("preferred_batch_sizes", 8), ("classes", ClassPolicy("normal")), ("classes", None)],
)
def test_decorator_refuses_a_keyword_that_is_no_sequence_with_config_error(keyword, value):
    """The keywords are BatchPolicy's fields, validated the same way: ConfigError naming
    the field (BatchPolicy(preferred_batch_sizes=8) says so), not a bare TypeError."""
    with pytest.raises(ConfigError) as caught:
        carpool.batched(**{keyword: value})(lambda batch: batch)
    assert caught.value.field == keyword


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("max_batch_size", 0, "an integer >= 1", file="carpool.yaml"),
        InvalidInput("bad payload", request_id=3),
        QueueFull("normal", 8),
        DeadlineExceeded(4, 0.1, 0.25),
        ModelError("the model raised ValueError: no", request_id=5),
        CapacityError(6, 2),
        Closed("w1"),
    ],
    ids=lambda error: type(error).__name__,
)
@pytest.mark.parametrize("clone", [copy.copy, lambda e: pickle.loads(pickle.dumps(e))])
def test_errors_survive_pickle_and_copy_with_their_fields_and_message(error, clone):
    """An error crossing a process (multiprocessing, a process pool) or copied keeps its
    class, message and fields; before, most raised TypeError when rebuilt, and Closed
    nested its own message."""
    fields = {k: v for k, v in vars(error).items() if not k.startswith("_")}
    again = clone(error)
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert {k: v for k, v in vars(again).items() if not k.startswith("_")} == fields
    assert isinstance(again, CarpoolError)


# -- stop() ----------------------------------------------------------------------------------


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


# -- one decorated function, several event loops ----------------------------------------------


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
