"""Edges of carpool.core found in review: each test failed before its fix (a model raising
CancelledError killed its replica, a second asyncio.run found a dead batcher, policy
fields of the wrong type, a token budget update, a class restored mid-batch, NumPy
numbers, an unhashable priority).

Bounded: every wait on the batcher has a short safety timeout, so a hang shows as a
failure, not a stuck run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

import numpy as np
import pytest

import carpool
from carpool import (
    Batcher,
    BatchPolicy,
    ClassPolicy,
    ConfigError,
    InvalidInput,
    ModelError,
)
from carpool.core.clock import FakeClock, settle

SAFETY_S = 2.0  # a net against a hung test, never a timing assertion


# -- a model error that asyncio mistakes for cancellation ---------------------------------


async def test_sync_model_raising_futures_cancelled_error_fails_only_its_batch():
    """``concurrent.futures.CancelledError`` is an ordinary ``Exception`` (a model that
    waits on a cancelled inner future raises it). It must become a ModelError for that
    batch, and the batcher must keep serving."""

    def fn(batch: list[int]) -> list[int]:
        if 1 in batch:
            raise concurrent.futures.CancelledError("an inner work item was cancelled")
        return [x * 10 for x in batch]

    batcher = Batcher(
        fn, BatchPolicy(max_batch_size=4, max_delay_s=0.0), clock=FakeClock(), executor="thread"
    )
    await batcher.start()
    try:
        with pytest.raises(ModelError):
            await asyncio.wait_for(batcher.submit(1), SAFETY_S)
        assert await asyncio.wait_for(batcher.submit(2), SAFETY_S) == 20
    finally:
        # Today the dead replica task re-raises its CancelledError from stop().
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(batcher.stop(drain=False), SAFETY_S)


# -- lifecycle across event loops and lazy starts ------------------------------------------


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


# -- policy validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preferred_batch_sizes", 8),
        ("classes", ("interactive", "normal")),
        ("classes", ClassPolicy("normal")),
    ],
)
def test_malformed_policy_field_raises_config_error_naming_it(field, value):
    """docs/core.md: 'a bad value raises ConfigError naming the field'."""
    with pytest.raises(ConfigError, match=field):
        BatchPolicy(**{field: value})


async def test_update_policy_refuses_max_batch_tokens_the_collator_cannot_measure():
    """Building a batcher with max_batch_tokens and a NumPy collator is a ConfigError;
    update_policy ("validated first") accepts the same setting and then ignores it."""
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        Batcher(lambda b: b, BatchPolicy(max_batch_tokens=8), collate="numpy")

    batcher = Batcher(lambda b: b, BatchPolicy(), collate="numpy", clock=FakeClock())
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        batcher.update_policy(max_batch_tokens=8)


# -- policy updates while batches run ------------------------------------------------------


async def test_class_removed_and_restored_while_its_batch_runs_keeps_its_share_cap(
    fake_clock, fake_model, spawn
):
    classes = (
        ClassPolicy("interactive"),
        ClassPolicy("normal"),
        ClassPolicy("background", share=0.5),  # one of two replicas
    )
    batcher = Batcher(
        fake_model,
        BatchPolicy(max_batch_size=1, max_delay_s=0.0, classes=classes),
        clock=fake_clock,
        num_replicas=2,
    )
    await batcher.start()
    try:
        fake_model.hold()
        first = spawn(batcher.submit(1, priority="background"))
        await settle()
        assert fake_model.running == 1

        batcher.update_policy(classes=classes[:2])  # no background request is queued
        batcher.update_policy(classes=classes)

        second = spawn(batcher.submit(2, priority="background"))
        await settle()
        assert fake_model.running == 1, "background now leads batches on both replicas"
    finally:
        fake_model.release()
        await asyncio.wait_for(batcher.stop(drain=True), SAFETY_S)
    assert [first.result(), second.result()] == [10, 20]


# -- request arguments ---------------------------------------------------------------------


async def test_numpy_integer_cost_is_accepted(make_batcher, spawn):
    """cost=array.sum() or np.prod(shape) is a NumPy integer: a valid finite cost."""
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    payload = np.ones(3)
    task = spawn(batcher.submit(payload, cost=np.int64(3)))
    await settle()
    np.testing.assert_array_equal(await asyncio.wait_for(task, SAFETY_S), payload * 10)


async def test_unhashable_priority_is_invalid_input(make_batcher):
    """docs/core.md: an unknown priority is InvalidInput (not a bare TypeError)."""
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    priority: Any = ["interactive"]
    with pytest.raises(InvalidInput, match="priority"):
        await batcher.submit(1, priority=priority)
