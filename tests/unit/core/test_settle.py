"""Settling a model call: results to each future, bisection to the failing request, OOM.

First on a Settler driven directly with a fake replica start, then through the Batcher:
model errors, wrong output counts, out of memory (the cap it lowers and how it recovers,
the failed call's memory freed before its halves run) and a model that raises what
asyncio takes for a cancellation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import weakref
from collections.abc import Awaitable
from typing import Any

import numpy as np
import pytest

from carpool import Batcher, CapacityError, ModelError
from carpool.core.admission import OomCap
from carpool.core.clock import FakeClock, settle
from carpool.core.collate import ListCollator
from carpool.core.model_call import Cancels, ModelCall, RunOutput
from carpool.core.policy import BatchPolicy
from carpool.core.request import Request, RequestState
from carpool.core.settle import Settler, Start, by_signature
from carpool.core.telemetry import Telemetry

from .conftest import SAFETY_S, finish

_ids = itertools.count()


def _request(payload: int, signature: object = None) -> Request:
    return Request(
        request_id=next(_ids),
        payload=payload,
        num_items=1,
        is_many=False,
        cost=1.0,
        class_name="normal",
        rank=1,
        arrival_s=0.0,
        deadline_s=None,
        future=asyncio.get_running_loop().create_future(),
        signature=signature,
    )


def _settler(oom: OomCap | None = None) -> Settler:
    telemetry = Telemetry("m", {c.name: c.slo_s for c in BatchPolicy().classes})
    return Settler(telemetry, FakeClock(), oom or OomCap(), "m")


def _model(bad: set[int], oom_above: int | None = None):  # type: ignore[no-untyped-def]
    calls: list[list[int]] = []

    def start(call: ModelCall) -> Awaitable[RunOutput]:
        async def run() -> RunOutput:
            payloads = call.payloads
            calls.append(payloads)
            if oom_above is not None and len(payloads) > oom_above:
                raise MemoryError("too big")
            if bad & set(payloads):
                raise ValueError("poison")
            return RunOutput([p * 10 for p in payloads], 0.0, 1.0)

        return run()

    return start, calls


async def _settle(settler: Settler, requests: list[Request], start: Start) -> RunOutput | None:
    call = ModelCall(requests, ListCollator(), Cancels())
    return await settler.settle(call, start(call), start)


async def test_results_reach_each_future_in_order() -> None:
    requests = [_request(i) for i in range(4)]
    start, _ = _model(set())
    output = await _settle(_settler(), requests, start)
    assert output is not None
    assert [r.future.result() for r in requests] == [0, 10, 20, 30]
    assert all(r.state is RequestState.DONE for r in requests)


async def test_bisection_fails_only_the_poisoned_request() -> None:
    requests = [_request(i) for i in range(8)]
    start, calls = _model({5})
    assert await _settle(_settler(), requests, start) is None
    for request in requests:
        if request.payload == 5:
            with pytest.raises(ModelError, match="ValueError: poison"):
                request.future.result()
        else:
            assert request.future.result() == request.payload * 10
    assert len(calls) > 2  # it bisected


async def test_out_of_memory_splits_and_lowers_the_cap() -> None:
    oom = OomCap()
    requests = [_request(i) for i in range(8)]
    start, _ = _model(set(), oom_above=2)
    await _settle(_settler(oom), requests, start)
    assert [r.future.result() for r in requests] == [i * 10 for i in range(8)]
    assert oom.current(0.0, BatchPolicy(max_batch_size=8)) == 2


async def test_a_request_out_of_memory_alone_gets_capacity_error() -> None:
    (request,) = requests = [_request(1)]
    start, _ = _model(set(), oom_above=0)
    await _settle(_settler(), requests, start)
    with pytest.raises(CapacityError):
        request.future.result()


async def test_by_signature_groups_and_keeps_order() -> None:
    a1, b1, a2 = _request(1, "a"), _request(2, "b"), _request(3, "a")
    assert by_signature([a1, b1, a2]) == [[a1, a2], [b1]]
    same = [_request(4, "a"), _request(5, "a")]
    assert by_signature(same) == [same]


# -- through the batcher ----------------------------------------------------------------------


async def test_one_item_out_of_memory_alone_fails_it_without_capping_every_batch_at_one(
    make_batcher, fake_model, spawn
):
    """A batch of one item cannot get any smaller: the request gets CapacityError, and
    nothing was learnt about batch sizes, so later batches keep their full size."""
    batcher = make_batcher(max_batch_size=8, max_delay_s=0.0)
    fake_model.fail_if = lambda items: MemoryError("huge input") if 99 in items else None
    (outcome,) = await finish(spawn(batcher.submit(99)))
    assert isinstance(outcome, CapacityError)
    assert batcher.effective_max_batch_size == 8


async def test_one_oversized_request_does_not_drag_the_oom_cap_down_to_one(
    make_batcher, fake_model, fake_clock, spawn
):
    """A batch of 8 runs out of memory because of one request. Bisection isolates it
    (it fails with CapacityError, the other 7 succeed in batches of up to 4); the cap is
    half the failed batch, not 1 because every half holding that request failed too."""
    batcher = make_batcher(max_batch_size=8, max_delay_s=1.0)
    fake_model.fail_if = lambda items: MemoryError("huge input") if 99 in items else None
    tasks = [spawn(batcher.submit(99))] + [spawn(batcher.submit(i)) for i in range(1, 8)]
    await settle()
    outcomes = await finish(*tasks)
    assert isinstance(outcomes[0], CapacityError)
    assert outcomes[1:] == [i * 10 for i in range(1, 8)]
    assert batcher.effective_max_batch_size == 4


@pytest.mark.parametrize("empty", [{}, ()], ids=["dict", "tuple"])
async def test_model_returning_an_empty_dict_or_tuple_is_a_model_error(make_batcher, spawn, empty):
    """No outputs at all is the wrong number of outputs: each caller used to get an empty
    {} or () as if it were its result."""

    async def fn(batch: Any) -> Any:
        return empty

    batcher = make_batcher(fn=fn, collate="packed", max_batch_size=4, max_delay_s=0.0)
    await batcher.start()
    outcomes = await finish(spawn(batcher.submit(np.ones(3))), spawn(batcher.submit(np.ones(2))))
    assert all(isinstance(o, ModelError) for o in outcomes), outcomes
    assert "returned 0 outputs" in str(outcomes[0])


@pytest.mark.parametrize(
    "payloads", [["a", "poison", "b", "c"], ["poison", "a", "b", "poison"]], ids=["one", "two"]
)
async def test_model_error_reaches_only_the_poisoned_requests(
    make_batcher, fake_model, spawn, payloads
):
    fake_model.fail_if = lambda items: ValueError("poison!") if "poison" in items else None
    batcher = make_batcher(collate="list", max_batch_size=4, max_delay_s=10.0)
    tasks = [spawn(batcher.submit(p)) for p in payloads]
    await settle()
    outcomes = await finish(*tasks)

    for payload, outcome in zip(payloads, outcomes, strict=True):
        if payload == "poison":
            assert isinstance(outcome, ModelError)
            assert isinstance(outcome.__cause__, ValueError)
            assert "poison!" in str(outcome)
        else:
            assert outcome == payload * 10
    stats = batcher.snapshot().classes["normal"]
    assert (stats.num_failed, stats.num_completed) == (
        payloads.count("poison"),
        len(payloads) - payloads.count("poison"),
    )


async def test_output_count_mismatch_fails_every_request_of_the_batch(make_batcher, spawn):
    async def drops_last(batch: list[int]) -> list[int]:
        return batch[:-1]

    batcher = make_batcher(fn=drops_last, max_batch_size=3, max_delay_s=10.0)
    tasks = [spawn(batcher.submit(i)) for i in range(3)]
    await settle()
    outcomes = await finish(*tasks)

    assert all(isinstance(o, ModelError) for o in outcomes)
    for outcome in outcomes:
        assert "2 outputs" in str(outcome)
        assert "3 items" in str(outcome)


async def test_out_of_memory_splits_the_batch_and_lowers_the_effective_size(
    make_batcher, fake_model, spawn
):
    fake_model.oom_above = 2
    batcher = make_batcher(max_batch_size=8, max_delay_s=10.0, oom_recovery_s=10.0)
    tasks = [spawn(batcher.submit(i)) for i in range(8)]
    await settle()

    assert [t.result() for t in tasks] == [i * 10 for i in range(8)]
    assert fake_model.sizes[0] == 8
    assert max(fake_model.sizes[1:]) <= 4
    assert batcher.effective_max_batch_size == 2


async def test_effective_size_doubles_back_after_oom_recovery_s(
    make_batcher, fake_model, fake_clock, spawn
):
    fake_model.oom_above = 2
    batcher = make_batcher(max_batch_size=8, max_delay_s=10.0, oom_recovery_s=10.0)
    for i in range(8):
        spawn(batcher.submit(i))
    await settle()
    fake_model.oom_above = None  # memory is free again
    calls = len(fake_model.batches)

    async def round_of_eight() -> list[int]:
        nonlocal calls
        tasks = [spawn(batcher.submit(i)) for i in range(8)]
        await settle()
        assert [t.result() for t in tasks] == [i * 10 for i in range(8)]
        sizes, calls = fake_model.sizes[calls:], len(fake_model.batches)
        return sizes

    assert await round_of_eight() == [2, 2, 2, 2]
    await fake_clock.advance(9.5)
    assert await round_of_eight() == [2, 2, 2, 2]
    await fake_clock.advance(0.5)
    assert await round_of_eight() == [4, 4]
    assert batcher.effective_max_batch_size == 4
    await fake_clock.advance(10.0)
    assert await round_of_eight() == [8]
    assert batcher.effective_max_batch_size == 8


async def test_request_out_of_memory_alone_gets_capacity_error(make_batcher, fake_model, spawn):
    fake_model.oom_above = 0
    batcher = make_batcher(max_batch_size=2, max_delay_s=10.0)
    tasks = [spawn(batcher.submit(i)) for i in range(2)]
    await settle()
    outcomes = await finish(*tasks)

    assert all(isinstance(o, CapacityError) for o in outcomes)
    assert all(isinstance(o.__cause__, MemoryError) for o in outcomes)
    assert batcher.snapshot().classes["normal"].num_failed == 2


async def test_request_larger_than_the_oom_cap_still_runs(
    make_batcher, fake_model, fake_clock, spawn
):
    fake_model.oom_above = 2
    batcher = make_batcher(max_batch_size=8, max_delay_s=1.0, oom_recovery_s=10.0)
    for i in range(8):
        spawn(batcher.submit(i))
    await settle()
    assert batcher.effective_max_batch_size == 2
    fake_model.oom_above = None

    task = spawn(batcher.submit_many(np.arange(4)))
    await fake_clock.advance(1.0)

    assert task.done(), "a request admitted under max_batch_size must not wait forever"
    np.testing.assert_array_equal(task.result(), np.arange(4) * 10)


async def test_payloads_of_different_shapes_run_in_separate_groups(make_batcher, spawn):
    shapes: list[tuple[int, ...]] = []

    async def row_sums(x: np.ndarray) -> np.ndarray:
        shapes.append(x.shape)
        return x.sum(axis=1)

    batcher = make_batcher(fn=row_sums, max_batch_size=3, max_delay_s=10.0)
    tasks = [spawn(batcher.submit(p)) for p in (np.ones(3), np.full(4, 2.0), np.ones(3))]
    await settle()

    assert [t.result() for t in tasks] == [3.0, 8.0, 3.0]
    assert shapes == [(2, 3), (1, 4)]
    assert batcher.snapshot().batches.num_batches == 1


async def test_effective_size_recovers_once_per_elapsed_period_without_new_batches(
    make_batcher, fake_model, fake_clock, spawn
):
    fake_model.oom_above = 1
    batcher = make_batcher(max_batch_size=8, max_delay_s=10.0, oom_recovery_s=10.0)
    for i in range(8):
        spawn(batcher.submit(i))
    await settle()
    assert batcher.effective_max_batch_size == 1
    # Three quiet periods pass with nothing submitted: the cap doubles three times.
    await fake_clock.advance(30.0)
    assert batcher.effective_max_batch_size == 8


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


class _Device:
    """A fake accelerator memory of ``budget`` units: an allocation is freed only when the
    last reference to it goes (as a CUDA tensor's memory is)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.in_use = 0

    def allocate(self) -> _Block:
        if self.in_use + 1 > self.budget:
            raise MemoryError(f"{self.in_use} of {self.budget} units in use")
        return _Block(self)


class _Block:
    def __init__(self, device: _Device) -> None:
        self.device = device
        device.in_use += 1

    def __del__(self) -> None:
        self.device.in_use -= 1


async def test_oom_halves_run_after_the_failed_batch_memory_is_freed(make_batcher, spawn):
    # The failed call's activations live in the frames of the exception's traceback.
    # Retrying the halves while that exception is still held (inside the except block)
    # keeps them allocated, so halves that fit fail too and every request gets
    # CapacityError (PyTorch's FAQ: recover from OOM outside the except clause).
    device = _Device(budget=3)

    async def model(batch: Any) -> Any:
        activations = []  # a local of the model's frame, as a forward pass's tensors are
        for _ in batch:
            activations.append(device.allocate())  # one unit per item
        return [x * 10 for x in batch]

    batcher = make_batcher(model, max_batch_size=4, max_delay_s=10.0)
    await batcher.start()
    tasks = [spawn(batcher.submit(i)) for i in range(4)]
    results = await finish(*tasks)
    assert results == [0, 10, 20, 30]
    assert device.in_use == 0


async def test_oom_halves_of_a_threaded_model_run_after_the_failed_batch_is_freed(
    make_batcher, spawn
):
    device = _Device(budget=3)

    def model(batch: Any) -> Any:
        activations = []
        for _ in batch:
            activations.append(device.allocate())
        return [x * 10 for x in batch]

    batcher = make_batcher(model, max_batch_size=4, max_delay_s=10.0, collate="list")
    await batcher.start()
    tasks = [spawn(batcher.submit(i)) for i in range(4)]
    results = await finish(*tasks)
    assert results == [0, 10, 20, 30]
    assert not any(isinstance(r, CapacityError) for r in results)


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


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


@pytest.mark.parametrize("executor", ["loop", "thread"])
@pytest.mark.parametrize("buffer_pool", [True, False])
async def test_oom_halves_run_after_the_failed_batchs_input_is_freed(
    executor: str, buffer_pool: bool
) -> None:
    """The failed call's input batch is gone before its halves run. Was: the pooled
    buffer stayed in the failed call's lease, and a thread's job kept the batch in its
    closure (a cleared frame still holds its function), so the halves ran beside it and
    could run out of memory only for that."""
    failed: list[weakref.ref[np.ndarray]] = []
    seen_alive: list[bool] = []

    def model(batch: np.ndarray) -> np.ndarray:
        if len(batch) > 2:
            failed.append(weakref.ref(_root(batch)))
            raise MemoryError("out of memory for a batch of more than two")
        seen_alive.extend(ref() is not None for ref in failed)
        return batch * 2

    batcher = Batcher(
        model,
        BatchPolicy(max_batch_size=4, max_delay_s=0.05),
        executor=executor,
        buffer_pool=buffer_pool,
        switch_interval_s=None,
    )
    async with batcher:
        rows = [np.full(1000, float(i)) for i in range(4)]
        results = await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(row) for row in rows)), SAFETY_S
        )
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result, np.full(1000, 2.0 * i))
    assert failed and seen_alive and not any(seen_alive)
