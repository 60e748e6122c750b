"""Settling a model call: results to each future, bisection to the failing request, OOM."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable

import pytest

from carpool import CapacityError, ModelError
from carpool.core.admission import OomCap
from carpool.core.clock import FakeClock
from carpool.core.policy import BatchPolicy
from carpool.core.collate import ListCollator
from carpool.core.replicas import Cancels, ModelCall, RunOutput
from carpool.core.request import Request, RequestState
from carpool.core.settle import Settler, Start, by_signature
from carpool.core.telemetry import Telemetry

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
