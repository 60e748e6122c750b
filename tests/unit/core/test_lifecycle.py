"""Stopping within a bound: ``stop(timeout_s=...)`` and ``cut_off()`` answer what a drain
has not finished in time with Closed, and leave a stuck replica thread behind."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock, settle
from carpool.errors import Closed, ConfigError

from .conftest import SAFETY_S, until


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
