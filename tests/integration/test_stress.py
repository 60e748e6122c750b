"""Concurrency stress: thousands of callers, a real clock, two replica threads, and
everything that goes wrong at once (cancelled callers, poisoned items, short deadlines).

No timing is asserted. What is asserted is bookkeeping: every caller that was not
cancelled gets exactly its own answer or the error its request deserves, no output is
delivered twice, every admitted request is answered exactly once, and the batcher drains
and stops.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

from carpool import (
    Batcher,
    BatchPolicy,
    Closed,
    DeadlineExceeded,
    ModelError,
    RequestTrace,
)

NUM_REQUESTS = 3000
PRIORITIES = [None, "interactive", "normal", "background"]


@dataclass(frozen=True, slots=True)
class Item:
    item_id: int
    is_poison: bool

    @property
    def expected(self) -> int:
        return self.item_id * 2


@dataclass(slots=True)
class Call:
    """One caller's plan: what it submits and how."""

    items: list[Item]
    is_many: bool
    priority: str | None
    timeout_s: float | None
    cancel_after_yields: int | None

    @property
    def is_poison(self) -> bool:
        return any(item.is_poison for item in self.items)


class CountingModel:
    """Doubles each item's id; raises on any batch holding a poison item.

    ``num_outputs[item_id]`` counts the batches that returned an output for an item:
    only those outputs can reach a caller, so each must be at most one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_outputs: Counter[int] = Counter()
        self.num_calls = 0
        self.threads: set[str] = set()

    def __call__(self, batch: list[Item]) -> list[int]:
        with self._lock:
            self.num_calls += 1
            self.threads.add(threading.current_thread().name)
        poisoned = [item.item_id for item in batch if item.is_poison]
        if poisoned:
            raise ValueError(f"poison items {poisoned}")
        with self._lock:
            self.num_outputs.update(item.item_id for item in batch)
        return [item.expected for item in batch]


def _plan_calls(rng: random.Random) -> list[Call]:
    calls: list[Call] = []
    next_id = 0
    for _ in range(NUM_REQUESTS):
        is_many = rng.random() < 0.1
        count = rng.randint(2, 3) if is_many else 1
        items = [Item(next_id + k, rng.random() < 0.03) for k in range(count)]
        next_id += count
        calls.append(
            Call(
                items=items,
                is_many=is_many,
                priority=rng.choice(PRIORITIES),
                timeout_s=rng.choice([0.0005, 0.002, 0.02]) if rng.random() < 0.1 else None,
                cancel_after_yields=rng.randint(0, 6) if rng.random() < 0.1 else None,
            )
        )
    return calls


async def _submit(batcher: Batcher, call: Call) -> Any:
    if call.is_many:
        return await batcher.submit_many(
            call.items, priority=call.priority, timeout_s=call.timeout_s
        )
    return await batcher.submit(call.items[0], priority=call.priority, timeout_s=call.timeout_s)


async def _cancel_later(task: asyncio.Task[Any], num_yields: int) -> None:
    for _ in range(num_yields):
        await asyncio.sleep(0)
    task.cancel()


def _check_outcome(call: Call, task: asyncio.Task[Any]) -> str:
    """Check one finished caller against its plan; returns its outcome's name."""
    if task.cancelled():
        assert call.cancel_after_yields is not None, "a caller nobody cancelled was cancelled"
        return "cancelled"
    error = task.exception()
    if error is None:
        result = task.result()
        assert not call.is_poison, "a poisoned request got a result"
        expected = [item.expected for item in call.items]
        assert (result if call.is_many else [result]) == expected, "someone else's answer"
        return "ok"
    if isinstance(error, ModelError):
        assert call.is_poison, f"ModelError for a clean request: {error}"
        assert isinstance(error.__cause__, ValueError)
        return "model_error"
    if isinstance(error, DeadlineExceeded):
        assert call.timeout_s is not None, "DeadlineExceeded without a timeout"
        assert error.timeout_s == pytest.approx(call.timeout_s)
        return "deadline"
    raise AssertionError(f"unexpected error {error!r}")


async def test_thousands_of_racing_callers_each_get_their_own_answer_exactly_once() -> None:
    rng = random.Random(20240601)
    calls = _plan_calls(rng)
    model = CountingModel()
    traces: list[RequestTrace] = []
    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=16, max_delay_s=0.001),
        name="stress",
        num_replicas=2,
        collate="list",
        on_trace=traces.append,
    )
    await batcher.start()

    tasks: list[asyncio.Task[Any]] = []
    cancellers: list[asyncio.Task[None]] = []
    position = 0
    while position < len(calls):
        wave = calls[position : position + rng.randint(1, 40)]
        position += len(wave)
        for call in wave:
            task = asyncio.create_task(_submit(batcher, call))
            tasks.append(task)
            if call.cancel_after_yields is not None:
                cancellers.append(
                    asyncio.create_task(_cancel_later(task, call.cancel_after_yields))
                )
        # Let arrivals interleave with batches: mostly loop turns, sometimes a short nap
        # so replica threads finish and deadline timers fire.
        if rng.random() < 0.2:
            await asyncio.sleep(0.0002)
        else:
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)

    await asyncio.sleep(0)  # every caller has run its first step: admitted or cancelled
    # Stop while requests are still queued and running: draining answers all of them.
    await batcher.stop(drain=True)
    await asyncio.gather(*cancellers)
    _, pending = await asyncio.wait(tasks, timeout=60)
    assert not pending, f"{len(pending)} callers never got an answer"

    assert not batcher.is_running
    assert batcher.num_pending == 0
    with pytest.raises(Closed):
        await batcher.submit(Item(-1, False))

    outcomes = Counter(_check_outcome(call, task) for call, task in zip(calls, tasks, strict=True))
    assert outcomes["ok"] > NUM_REQUESTS // 2, outcomes
    assert outcomes["model_error"] > 0, outcomes
    assert outcomes["cancelled"] > 0, outcomes

    # Nothing answered twice: each item's output left the model at most once, and every
    # clean request that was answered OK had exactly one output per item.
    assert max(model.num_outputs.values()) == 1
    for call, task in zip(calls, tasks, strict=True):
        if not task.cancelled() and task.exception() is None:
            assert all(model.num_outputs[item.item_id] == 1 for item in call.items)
        if call.is_poison:
            assert all(
                model.num_outputs[item.item_id] == 0 for item in call.items if item.is_poison
            )
    assert len(model.threads) <= 2

    # Every admitted request was answered exactly once (one trace each), and the
    # snapshot's counts add up.
    trace_ids = [trace.request_id for trace in traces]
    assert len(trace_ids) == len(set(trace_ids)), "a request answered twice"
    snapshot = batcher.snapshot()
    classes = snapshot.classes.values()
    num_requests = sum(c.num_requests for c in classes)
    num_answered = sum(c.num_completed + c.num_failed + sum(c.rejections.values()) for c in classes)
    assert num_requests == num_answered == len(traces)
    # Callers cancelled before their first step were never admitted; all others were.
    assert NUM_REQUESTS - outcomes["cancelled"] <= num_requests <= NUM_REQUESTS
    assert snapshot.num_pending == 0
    assert sum(c.num_failed for c in classes) >= outcomes["model_error"]
    assert sum(c.rejections.get("deadline", 0) for c in classes) >= outcomes["deadline"]
    assert all(set(c.rejections) <= {"cancelled", "deadline"} for c in classes)
    assert snapshot.batches.num_batches >= 1
    assert all(size <= 16 for size in snapshot.batches.size_histogram)
