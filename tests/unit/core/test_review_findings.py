"""Regression tests for bugs found in review of the batcher, scheduler and replicas.

Each test names the behaviour that was broken; the fixtures come from ``conftest.py``
(a FakeClock, an async ``FakeModel``, a thread-blocking ``BlockingSyncModel``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from carpool import Batcher, ClassPolicy, ConfigError
from carpool.core.clock import settle

SAFETY_S = 5.0  # a net against a hung test, never a timing assertion


async def finish(*tasks: asyncio.Task[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)


# -- scheduler: aging and share caps -------------------------------------------------------


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


# -- lifecycle -------------------------------------------------------------------------------


async def test_stop_during_start_leaves_the_batcher_stopped(make_batcher, spawn):
    batcher = make_batcher(max_delay_s=0.0)
    starting = spawn(batcher.start())
    await asyncio.sleep(0)  # start() is now loading the replicas
    assert not starting.done()

    await batcher.stop()
    await finish(starting)

    assert not batcher.is_running
    with pytest.raises(Exception, match="not accepting requests"):
        await batcher.submit(1)


def test_empty_devices_is_refused_naming_devices():
    with pytest.raises(ConfigError, match="devices") as info:
        Batcher(lambda batch: batch, devices=[])
    assert info.value.field == "devices"


# -- out of memory recovery ------------------------------------------------------------------


async def test_oom_cap_doubles_once_per_recovery_period_however_often_it_is_read(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=64, max_delay_s=1.0, oom_recovery_s=30.0)
    fake_model.oom_above = 4
    tasks = [spawn(batcher.submit(i)) for i in range(8)]
    await fake_clock.advance(1.0)
    assert await finish(*tasks) == [i * 10 for i in range(8)]
    assert batcher.effective_max_batch_size == 4

    await fake_clock.advance(45.0)  # one period (30 s) has passed: 4 -> 8
    assert batcher.effective_max_batch_size == 8
    await fake_clock.advance(15.0)  # 60 s since the OOM: two periods, 4 -> 16
    assert batcher.effective_max_batch_size == 16


# -- user callbacks that raise -------------------------------------------------------------


async def test_raising_on_trace_hook_does_not_strand_the_batch(
    make_batcher, spawn, caplog, loop_errors
):
    def hook(trace: object) -> None:
        raise RuntimeError("bug in the hook")

    batcher = make_batcher(max_batch_size=2, max_delay_s=10.0, on_trace=hook)
    with caplog.at_level(logging.ERROR, logger="carpool"):
        first = [spawn(batcher.submit(i)) for i in range(2)]
        await settle()
        assert all(t.done() for t in first), "every request of the batch is answered"
        later = [spawn(batcher.submit(i)) for i in range(2, 4)]
        await settle()
    assert [t.result() for t in first + later] == [0, 10, 20, 30]
    assert "on_trace" in caplog.text
    await batcher.stop()
    assert loop_errors == []


async def test_raising_memory_probe_does_not_kill_the_replica(make_batcher, spawn, caplog):
    def probe() -> tuple[int, int]:
        raise OSError("device went away")

    batcher = make_batcher(max_batch_size=1, max_delay_s=10.0, memory_probe=probe)
    with caplog.at_level(logging.ERROR, logger="carpool"):
        tasks = [spawn(batcher.submit(i)) for i in range(3)]
        await settle()
    assert [t.result() for t in tasks if t.done()] == [0, 10, 20]
    assert "memory_probe" in caplog.text
    await batcher.stop()
