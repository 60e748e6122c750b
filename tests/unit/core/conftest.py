"""Fakes and factories for the batcher and decorator tests.

Time is a :class:`FakeClock`; models are small fakes that record every batch they see
and can be held mid-batch (an ``asyncio.Event`` for async models, a ``threading.Event``
for sync ones) so that a test decides exactly when a replica is busy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, BatchPolicy
from carpool.core.clock import FakeClock

SAFETY_S = 5.0  # only a net against a hung test, never a timing assertion


class FakeModel:
    """An async batched model that records each batch and the (fake) time it started.

    ``hold()`` makes every call wait until ``release()``; ``fail_if`` raises for a batch;
    ``oom_above`` raises ``MemoryError`` for batches larger than it.
    """

    def __init__(
        self,
        clock: FakeClock,
        transform: Callable[[Any], Any] = lambda x: x * 10,
    ) -> None:
        self.clock = clock
        self.transform = transform
        self.batches: list[list[Any]] = []
        self.started_at: list[float] = []
        self.running = 0
        self.max_running = 0
        self.fail_if: Callable[[list[Any]], BaseException | None] | None = None
        self.oom_above: int | None = None
        self._gate = asyncio.Event()
        self._gate.set()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]

    async def __call__(self, batch: Any) -> Any:
        items = list(batch)
        self.batches.append(items)
        self.started_at.append(self.clock.now())
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self._gate.wait()
        finally:
            self.running -= 1
        if self.oom_above is not None and len(items) > self.oom_above:
            raise MemoryError(f"cannot fit a batch of {len(items)}")
        if self.fail_if is not None and (error := self.fail_if(items)) is not None:
            raise error
        if isinstance(batch, np.ndarray):
            return self.transform(batch)
        return [self.transform(x) for x in items]


class BlockingSyncModel:
    """A sync batched model: it runs on a replica thread and blocks on ``gate``.

    Each call announces itself on ``entered`` (an asyncio queue, fed thread-safely) with
    the batch it got and the name of the thread it runs on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.gate = threading.Event()
        self.entered: asyncio.Queue[tuple[list[Any], str]] = asyncio.Queue()
        self.sizes: list[int] = []

    def __call__(self, batch: Any) -> Any:
        items = list(batch)
        self.sizes.append(len(items))
        self.loop.call_soon_threadsafe(
            self.entered.put_nowait, (items, threading.current_thread().name)
        )
        if not self.gate.wait(SAFETY_S):
            raise RuntimeError("test never released the model")
        return [x * 10 for x in items]

    async def wait_entered(self) -> tuple[list[Any], str]:
        return await asyncio.wait_for(self.entered.get(), SAFETY_S)


async def finish(*tasks: asyncio.Task[Any]) -> list[Any]:
    """Each task's result or exception, waited for at most SAFETY_S."""
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), SAFETY_S)


async def occupy(
    batcher: Batcher, model: Any, spawn: Any, clock: FakeClock, blocker: Any = -1
) -> asyncio.Task[Any]:
    """Make the (single) replica busy: a blocker request runs and is held in the model."""
    model.hold()
    task = spawn(batcher.submit(blocker))
    await clock.advance(batcher.policy.max_delay_s)
    assert model.running == 1, "the blocker should be running"
    return task


async def until(condition: Callable[[], bool]) -> None:
    """Wait, in real time bounded by SAFETY_S, for what a replica thread does."""
    async with asyncio.timeout(SAFETY_S):
        while not condition():  # noqa: ASYNC110 - set by a thread, not the loop
            await asyncio.sleep(0.001)


class Spawner:
    """Creates tasks on the loop and makes sure none outlives the test."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []

    def __call__(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake_model(fake_clock: FakeClock) -> Iterator[FakeModel]:
    model = FakeModel(fake_clock)
    yield model
    model.release()


@pytest.fixture
async def spawn() -> AsyncIterator[Spawner]:
    spawner = Spawner()
    yield spawner
    await spawner.close()


@pytest.fixture
async def make_batcher(
    fake_clock: FakeClock, fake_model: FakeModel
) -> AsyncIterator[Callable[..., Batcher]]:
    """``make_batcher(fn=..., num_replicas=..., collate=..., **policy_fields)``.

    The model defaults to ``fake_model``; every batcher made is stopped at teardown.
    """
    made: list[Batcher] = []
    released: list[Callable[[], None]] = [fake_model.release]

    def factory(fn: Any = None, **kwargs: Any) -> Batcher:
        options = {
            k: kwargs.pop(k)
            for k in (
                "name",
                "num_replicas",
                "devices",
                "fn_factory",
                "collate",
                "on_trace",
                "slow_request_s",
                "memory_probe",
            )
            if k in kwargs
        }
        if fn is None and "fn_factory" not in options:
            fn = fake_model
        if isinstance(fn, BlockingSyncModel):
            released.append(fn.gate.set)
        batcher = Batcher(fn, BatchPolicy(**kwargs), clock=fake_clock, **options)
        made.append(batcher)
        return batcher

    yield factory
    for release in released:
        release()
    for batcher in made:
        await asyncio.wait_for(batcher.stop(drain=False), SAFETY_S)


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the event loop's exception handler during the test (should be nothing)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)


@pytest.fixture
async def sync_model() -> BlockingSyncModel:
    return BlockingSyncModel(asyncio.get_running_loop())
