"""FakeClock: time moves only on advance; timers fire in time order; cancelled never fire."""

from __future__ import annotations

import asyncio

import pytest

from carpool import FakeClock
from carpool.core.clock import MonotonicClock, settle


def test_fake_clock_starts_where_told_and_stands_still() -> None:
    clock = FakeClock(start_s=5.0)
    assert clock.now() == 5.0
    assert clock.now() == 5.0


async def test_advance_moves_time_by_delta() -> None:
    clock = FakeClock(start_s=0.0)
    await clock.advance(1.5)
    await clock.advance(0.25)
    assert clock.now() == 1.75


async def test_timers_fire_in_time_order_not_registration_order() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[tuple[str, float]] = []
    for name, when in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
        clock.call_at(when, lambda name=name: fired.append((name, clock.now())))
    await clock.advance(10.0)
    assert fired == [("a", 1.0), ("b", 2.0), ("c", 3.0)]
    assert clock.now() == 10.0


async def test_timers_at_the_same_time_fire_in_registration_order() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[int] = []
    for i in range(5):
        clock.call_at(1.0, lambda i=i: fired.append(i))
    await clock.advance(1.0)
    assert fired == [0, 1, 2, 3, 4]


async def test_timers_fire_only_when_their_time_is_reached() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[str] = []
    clock.call_at(1.0, lambda: fired.append("early"))
    clock.call_at(2.0, lambda: fired.append("late"))
    await clock.advance(0.999)
    assert fired == []
    await clock.advance(0.001)
    assert fired == ["early"]
    assert clock.num_pending_timers == 1
    assert clock.next_timer_s() == 2.0


async def test_timer_in_the_past_fires_on_next_advance_without_moving_time_back() -> None:
    clock = FakeClock(start_s=10.0)
    seen: list[float] = []
    clock.call_at(3.0, lambda: seen.append(clock.now()))
    await clock.advance(0.0)
    assert seen == [10.0]


async def test_cancelled_timers_never_fire() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[str] = []
    keep = clock.call_at(1.0, lambda: fired.append("keep"))
    drop = clock.call_at(0.5, lambda: fired.append("drop"))
    drop.cancel()
    assert clock.num_pending_timers == 1
    assert clock.next_timer_s() == 1.0
    await clock.advance(5.0)
    assert fired == ["keep"]
    keep.cancel()  # cancelling after it fired is harmless
    assert clock.num_pending_timers == 0
    assert clock.next_timer_s() is None


async def test_timer_cancelled_by_an_earlier_timer_does_not_fire() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[str] = []
    later = clock.call_at(2.0, lambda: fired.append("later"))
    clock.call_at(1.0, later.cancel)
    await clock.advance(3.0)
    assert fired == []


async def test_timer_set_by_a_callback_within_the_window_fires_in_the_same_advance() -> None:
    clock = FakeClock(start_s=0.0)
    fired: list[tuple[str, float]] = []

    def first() -> None:
        fired.append(("first", clock.now()))
        clock.call_at(clock.now() + 1.0, lambda: fired.append(("second", clock.now())))

    clock.call_at(1.0, first)
    await clock.advance(2.5)
    assert fired == [("first", 1.0), ("second", 2.0)]


async def test_tasks_woken_by_a_timer_run_before_advance_returns() -> None:
    clock = FakeClock(start_s=0.0)
    event = asyncio.Event()
    seen: list[float] = []

    async def waiter() -> None:
        await event.wait()
        seen.append(clock.now())

    task = asyncio.create_task(waiter())
    clock.call_at(1.0, event.set)
    await clock.advance(1.0)
    assert seen == [1.0]
    assert task.done()
    await task


async def test_settle_lets_a_chain_of_ready_tasks_finish() -> None:
    steps: list[int] = []

    async def chain() -> None:
        for i in range(5):
            steps.append(i)
            await asyncio.sleep(0)

    task = asyncio.create_task(chain())
    await settle()
    assert steps == [0, 1, 2, 3, 4]
    assert task.done()
    await task


def test_monotonic_clock_never_goes_back() -> None:
    clock = MonotonicClock()
    readings = [clock.now() for _ in range(100)]
    assert readings == sorted(readings)


async def test_monotonic_clock_timer_can_be_cancelled_before_it_fires() -> None:
    clock = MonotonicClock()
    fired: list[bool] = []
    handle = clock.call_at(clock.now() - 1.0, lambda: fired.append(True))  # due at once
    handle.cancel()
    # A timer armed after it and due at once too: by the time it has fired, the loop has
    # run (or skipped) the cancelled one.
    later = asyncio.get_running_loop().create_future()
    clock.call_at(clock.now() - 1.0, lambda: later.set_result(None))
    await asyncio.wait_for(later, timeout=60)
    assert fired == []


async def test_monotonic_clock_timer_in_the_past_fires_on_the_next_loop_turn() -> None:
    clock = MonotonicClock()
    done = asyncio.get_running_loop().create_future()
    clock.call_at(clock.now() - 1.0, lambda: done.set_result(True))
    assert await asyncio.wait_for(done, timeout=60) is True


def test_monotonic_clock_timers_never_fire_early_on_uvloop() -> None:
    """uvloop rounds a timer's delay to the nearest millisecond: a quarter of timers with
    delays between 0.5 and 10 ms fired up to half a millisecond early, and a deadline
    refused a request still in time. The clock arms such a timer again."""
    import random

    import uvloop

    async def fire_all() -> list[float]:
        clock = MonotonicClock()
        loop = asyncio.get_running_loop()
        rng = random.Random(0)
        lateness: list[float] = []
        done = loop.create_future()
        whens = [clock.now() + rng.uniform(0.0005, 0.01) for _ in range(60)]

        def fired(when_s: float) -> None:
            lateness.append(clock.now() - when_s)
            if len(lateness) == len(whens):
                done.set_result(None)

        for when_s in whens:
            clock.call_at(when_s, lambda w=when_s: fired(w))
        await asyncio.wait_for(done, timeout=60)
        return lateness

    assert min(uvloop.run(fire_all())) >= 0.0


def test_monotonic_clock_timers_let_go_of_their_callbacks_without_the_collector() -> None:
    """A timer fired or cancelled frees what its callback holds by reference counting
    alone: a timer that kept a cycle left every request with a deadline (its future, its
    payload) to the cyclic collector, whose pauses grew with the traffic."""
    import gc
    import weakref

    import uvloop

    class Held:
        pass

    async def arm_and_drop() -> list[weakref.ref[Held]]:
        clock = MonotonicClock()
        refs = []
        for index in range(20):
            held = Held()
            refs.append(weakref.ref(held))
            timer = clock.call_at(clock.now() + (0.001 if index % 2 else 3600.0), lambda h=held: h)
            if index % 2 == 0:
                timer.cancel()
            del held, timer
        await asyncio.sleep(0.05)  # the other half fire
        return refs

    gc.disable()
    try:
        for run in (uvloop.run, asyncio.run):
            refs = run(arm_and_drop())
            assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("delta_s", [0.0, 1e-9, 123.0])
async def test_advance_with_no_timers_only_moves_time(delta_s: float) -> None:
    clock = FakeClock(start_s=1.0)
    await clock.advance(delta_s)
    assert clock.now() == 1.0 + delta_s


async def test_cancelled_fake_timers_let_go_of_their_callbacks_at_once() -> None:
    """A timer cancelled long before its time (a batch's watchdog) frees what its callback
    holds when cancelled, not when its time would have come."""
    import weakref

    class Held:
        pass

    clock = FakeClock(start_s=0.0)
    held = Held()
    ref = weakref.ref(held)
    timer = clock.call_at(3600.0, lambda h=held: h)
    del held

    timer.cancel()

    assert ref() is None
    assert clock.num_pending_timers == 0


async def test_fake_clock_fires_live_timers_in_order_among_many_cancelled() -> None:
    """Thousands of timers cancelled (the heap rebuilt without them, more than once), a
    few live ones: those fire, in time order; none cancelled ever does."""
    clock = FakeClock(start_s=0.0)
    fired: list[float] = []
    live = [5.0, 1.0, 3.0]
    for when_s in live:
        clock.call_at(when_s, lambda w=when_s: fired.append(w))
    for index in range(5000):
        timer = clock.call_at(0.5 + index * 1e-3, lambda: fired.append(-1.0))
        timer.cancel()
        timer.cancel()  # twice is once
    late = clock.call_at(2.0, lambda: fired.append(2.0))

    assert clock.num_pending_timers == 4
    assert clock.next_timer_s() == 1.0
    await clock.advance(10.0)
    late.cancel()  # after it fired: harmless, counts for nothing

    assert fired == [1.0, 2.0, 3.0, 5.0]
    assert clock.num_pending_timers == 0
    assert clock.next_timer_s() is None
