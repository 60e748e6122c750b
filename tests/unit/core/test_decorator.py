"""Behaviour of ``@carpool.batched``: a batched function becomes an awaitable per-item one."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import carpool
from carpool import (
    BatchedFunction,
    BatchPolicy,
    ClassPolicy,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
)
from carpool.core.clock import FakeClock, settle

SAFETY_S = 5.0  # a net against a hung test, never a timing assertion


@pytest.fixture
async def stopped_at_teardown():
    """Collects decorated functions and stops them (without draining) after the test."""
    functions: list[BatchedFunction] = []
    yield functions.append
    for function in functions:
        await asyncio.wait_for(function.stop(drain=False), SAFETY_S)


async def test_bare_decorator_wraps_with_the_default_policy(stopped_at_teardown):
    @carpool.batched
    async def double(xs: list[int]) -> list[int]:
        """Doubles each item."""
        return [x * 2 for x in xs]

    stopped_at_teardown(double)
    assert isinstance(double, BatchedFunction)
    assert double.__name__ == "double"
    assert double.__doc__ == "Doubles each item."
    assert double.batcher.policy == BatchPolicy()
    assert double.batcher.name == "double"

    double.update_policy(max_delay_s=0.0)  # the default 5 ms would need a real timer
    assert await double(21) == 42
    assert double.batcher.is_running  # started lazily by the first call


async def test_keywords_become_the_policy(stopped_at_teardown):
    def cost(payload: str) -> float:
        return float(len(payload))

    @carpool.batched(
        max_batch_size=8,
        max_delay_s=0.25,
        preferred_batch_sizes=(2, 4),
        max_batch_cost=100.0,
        cost_fn=cost,
        max_queue_size=64,
        timeout_s=3.0,
        oom_recovery_s=7.0,
        fill_from_lower=False,
        name="shout",
        clock=FakeClock(),
    )
    async def shout(xs: list[str]) -> list[str]:
        return [x.upper() for x in xs]

    stopped_at_teardown(shout)
    policy = shout.batcher.policy
    assert (policy.max_batch_size, policy.max_delay_s) == (8, 0.25)
    assert policy.preferred_batch_sizes == (2, 4)
    assert (policy.max_batch_cost, policy.cost_fn) == (100.0, cost)
    assert (policy.max_queue_size, policy.timeout_s) == (64, 3.0)
    assert (policy.oom_recovery_s, policy.fill_from_lower) == (7.0, False)
    assert shout.batcher.name == "shout"


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("max_batch_size", 0),
        ("max_delay_s", -0.001),
        ("preferred_batch_sizes", (64,)),
        ("max_batch_cost", 0),
        ("cost_fn", "len"),
        ("max_queue_size", 0),
        ("timeout_s", 0),
        ("oom_recovery_s", float("nan")),
        ("default_class", "vip"),
        ("num_replicas", 0),
        ("collate", "arrow"),
    ],
)
def test_invalid_keyword_raises_config_error_at_decoration(keyword, value):
    async def model(xs: list[int]) -> list[int]:
        return xs

    with pytest.raises(ConfigError) as caught:
        carpool.batched(**{keyword: value})(model)

    assert caught.value.field == keyword
    assert keyword in str(caught.value)


async def test_priority_and_timeout_pass_through_the_call(stopped_at_teardown):
    clock = FakeClock()
    gate = asyncio.Event()
    seen: list[list[str]] = []

    @carpool.batched(
        max_delay_s=0.0,
        clock=clock,
        classes=(ClassPolicy("interactive"), ClassPolicy("normal")),
        fill_from_lower=False,
    )
    async def echo(xs: list[str]) -> list[str]:
        seen.append(list(xs))
        await gate.wait()
        return xs

    stopped_at_teardown(echo)
    blocker = asyncio.create_task(echo("blocker"))
    await settle()
    normal = asyncio.create_task(echo("n"))
    urgent = asyncio.create_task(echo("i", priority="interactive", timeout_s=1.0))
    doomed = asyncio.create_task(echo("late", priority="interactive", timeout_s=0.1))
    await clock.advance(0.1)

    gate.set()
    results = await asyncio.gather(blocker, normal, urgent, doomed, return_exceptions=True)
    assert results[:3] == ["blocker", "n", "i"]
    assert isinstance(results[3], DeadlineExceeded)
    assert seen == [["blocker"], ["i"], ["n"]]  # interactive went first, "late" never ran


async def test_unknown_priority_raises_invalid_input(stopped_at_teardown):
    @carpool.batched(max_delay_s=0.0, clock=FakeClock())
    async def echo(xs: list[int]) -> list[int]:
        return xs

    stopped_at_teardown(echo)
    with pytest.raises(InvalidInput, match="unknown priority 'vip'"):
        await echo(1, priority="vip")
    assert await echo(2, priority="background") == 2


async def test_many_returns_one_output_per_item(stopped_at_teardown):
    @carpool.batched(max_batch_size=4, max_delay_s=0.0, clock=FakeClock())
    async def square(x: np.ndarray) -> np.ndarray:
        return x**2

    stopped_at_teardown(square)
    rows = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(await square.many(rows), rows**2)
    with pytest.raises(InvalidInput, match="max_batch_size"):
        await square.many(np.ones((5, 2)))


async def test_context_manager_drains_pending_calls():
    clock = FakeClock()

    @carpool.batched(max_delay_s=10.0, clock=clock)
    async def negate(xs: list[int]) -> list[int]:
        return [-x for x in xs]

    async with negate:
        tasks = [asyncio.create_task(negate(i)) for i in range(3)]
        await settle()
        assert not any(t.done() for t in tasks)

    assert await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_S) == [0, -1, -2]
    assert clock.now() == 1000.0
    with pytest.raises(carpool.Closed):
        await negate(3)


async def test_sync_function_runs_on_a_replica_thread(stopped_at_teardown):
    threads: list[str] = []

    @carpool.batched(max_delay_s=0.0, clock=FakeClock())
    def triple(xs: list[int]) -> list[int]:
        threads.append(threading.current_thread().name)
        return [x * 3 for x in xs]

    stopped_at_teardown(triple)
    assert await asyncio.wait_for(triple(5), SAFETY_S) == 15
    assert threads[0].startswith("carpool-triple-r0")


async def test_snapshot_and_stop_pass_through_to_the_batcher():
    @carpool.batched(max_delay_s=0.0, clock=FakeClock())
    async def echo(xs: list[Any]) -> list[Any]:
        return xs

    await echo.start()
    assert await echo("a") == "a"
    assert echo.snapshot().classes["normal"].num_completed == 1
    await echo.stop()
    assert not echo.batcher.is_running


def test_decorator_takes_every_policy_field_by_its_name() -> None:
    import dataclasses
    import inspect

    from carpool import BatchPolicy

    keywords = inspect.signature(carpool.batched).parameters
    missing = [f.name for f in dataclasses.fields(BatchPolicy) if f.init and f.name not in keywords]
    assert missing == []


async def test_packed_collation_and_token_budget_through_the_decorator() -> None:
    from carpool.core.layout import Packed

    seen: list[list[int]] = []

    @carpool.batched(collate="packed", max_batch_size=8, max_batch_tokens=6, max_delay_s=0)
    async def total(batch: Packed) -> np.ndarray:
        seen.append(batch.lengths.tolist())
        return np.add.reduceat(batch.data, batch.offsets)

    async with total:
        results = await asyncio.gather(*(total(np.arange(1, n + 1)) for n in (3, 3, 2)))
    assert results == [6, 6, 3]
    assert all(sum(lengths) <= 6 for lengths in seen)
    assert total.snapshot().batches.num_tokens == 8


class Scaler:
    """A model object whose batched method reads its own state, as with Ray's
    ``@serve.batch`` on a deployment's method."""

    def __init__(self, factor: int) -> None:
        self.factor = factor
        self.batch_sizes: list[int] = []

    @carpool.batched(max_batch_size=8, max_delay_s=0.05)
    async def scale(self, xs: list[int]) -> list[int]:
        self.batch_sizes.append(len(xs))
        return [x * self.factor for x in xs]

    @carpool.batched(max_batch_size=8, max_delay_s=0.05)
    def scale_sync(self, xs: list[int]) -> list[int]:
        return [x * self.factor for x in xs]


async def test_a_method_batches_per_instance_with_its_self() -> None:
    twice, thrice = Scaler(2), Scaler(3)
    try:
        got = await asyncio.wait_for(
            asyncio.gather(
                *(twice.scale(i) for i in range(4)), *(thrice.scale(i) for i in range(4))
            ),
            SAFETY_S,
        )
        assert got == [0, 2, 4, 6, 0, 3, 6, 9]
        assert twice.batch_sizes == [4] and thrice.batch_sizes == [4]  # one batch each
        assert twice.scale is twice.scale and twice.scale is not thrice.scale
        assert twice.scale.batcher is not thrice.scale.batcher
        assert await asyncio.wait_for(thrice.scale_sync(5), SAFETY_S) == 15
        assert isinstance(Scaler.scale, BatchedFunction)  # on the class: the descriptor
        assert twice.scale.__name__ == "scale"
    finally:
        for model in (twice, thrice):
            await model.scale.stop()
            await model.scale_sync.stop()


def test_a_method_on_a_class_without_dict_says_why() -> None:
    class Slotted:
        __slots__ = ()

        @carpool.batched
        async def run(self, xs: list[int]) -> list[int]:
            return xs

    with pytest.raises(TypeError, match="__slots__"):
        Slotted().run  # noqa: B018


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


def _double(batch: Any) -> Any:
    return batch * 2


def test_batched_decorator_refuses_what_is_not_callable() -> None:
    with pytest.raises(ConfigError) as caught:
        carpool.batched(42)
    assert caught.value.field == "fn"


def test_batched_decorator_refuses_a_device_string_that_is_not_a_list() -> None:
    with pytest.raises(ConfigError) as caught:
        carpool.batched(devices="cuda:0")(_double)  # type: ignore[arg-type]
    assert caught.value.field == "devices"


async def test_stop_with_a_timeout_and_cut_off_work_on_the_decorated_function() -> None:
    """docs/core.md's lifecycle, on the decorated object itself: stop(timeout_s=) was a
    TypeError and cut_off() did not exist there."""
    entered, release = threading.Event(), threading.Event()

    @carpool.batched(max_batch_size=1, max_delay_s=0.0)
    def held(batch: list[int]) -> list[int]:
        entered.set()
        release.wait(SAFETY_S)
        return batch

    first = asyncio.ensure_future(held(1))
    assert await asyncio.to_thread(entered.wait, SAFETY_S)
    queued = asyncio.ensure_future(held(2))
    await asyncio.sleep(0)
    await held.stop(timeout_s=0.01)  # the held batch outlives it: the rest is cut off
    release.set()
    for task in (first, queued):
        with pytest.raises(carpool.Closed):
            await asyncio.wait_for(task, SAFETY_S)
    assert held.cut_off() == 0  # nothing left
