"""The trace hub (carpool.server.timelines): hooks on the batchers only while someone
listens, every finished request handed to each listener with its model's name, and the
``/v2/timelines`` query and document."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

from carpool import Batcher
from carpool.core.request import Outcome, RequestTrace
from carpool.errors import InvalidInput
from carpool.generation.telemetry import GenerationTrace
from carpool.server.repository import ModelRepository, ServedModel, TensorSpec
from carpool.server.timelines import (
    MAX_CAPTURE_S,
    Capture,
    TraceHub,
    capture,
    capture_seconds,
    timeline_document,
)

SPEC = TensorSpec("INPUT0", "FP32", (-1,))


def _doubled(batch: list[Any]) -> list[Any]:
    return [2 * x for x in batch]


@pytest.fixture
def repository() -> ModelRepository:
    models = [
        ServedModel(name, "1", "python", (SPEC,), (SPEC,), Batcher(_doubled, name=name))
        for name in ("a", "b")
    ]
    return ModelRepository(models)


def _batcher(repository: ModelRepository, name: str) -> Batcher:
    batcher = repository.get(name, None).batcher
    assert batcher is not None
    return batcher


async def test_listeners_get_every_finished_request_while_subscribed(
    repository: ModelRepository,
) -> None:
    hub = TraceHub(repository)
    seen: list[tuple[str, RequestTrace]] = []

    def listener(model: str, trace: RequestTrace) -> None:
        seen.append((model, trace))

    await repository.start()
    try:
        hub.subscribe(listener)
        assert await _batcher(repository, "a").submit(np.float32(1)) == 2
        assert await _batcher(repository, "b").submit(np.float32(3)) == 6
        hub.unsubscribe(listener)
        await _batcher(repository, "a").submit(np.float32(5))
    finally:
        await repository.stop()
    assert [(model, t.outcome) for model, t in seen] == [("a", Outcome.OK), ("b", Outcome.OK)]
    trace = seen[0][1]
    moments = [
        trace.arrived_s,
        trace.batch_closed_s,
        trace.compute_started_s,
        trace.compute_ended_s,
        trace.answered_s,
    ]
    assert moments == sorted(moments)


async def test_no_trace_is_built_once_the_last_listener_leaves(
    repository: ModelRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = TraceHub(repository)
    first, second = Capture(), Capture()
    hub.subscribe(first)
    hub.subscribe(second)
    hub.unsubscribe(first)
    assert hub.num_listeners == 1
    hub.unsubscribe(second)
    built: list[object] = []
    monkeypatch.setattr("carpool.core.telemetry.trace_of", lambda *a: built.append(a))
    # The slowest-request figure (carpool top) keeps a trace of its own: not the hub's.
    monkeypatch.setattr("carpool.core.telemetry.Telemetry._keep_slowest", lambda *a: None)
    await repository.start()
    try:
        await _batcher(repository, "a").submit(np.float32(1))
    finally:
        await repository.stop()
    assert built == []
    assert first.timelines == [] and second.timelines == []


def test_a_capture_keeps_its_bound_and_counts_the_rest() -> None:
    capture = Capture(max_captured=2)
    trace = _trace()
    for _ in range(5):
        capture("m", trace)
    assert len(capture.timelines) == 2
    assert capture.num_dropped == 3


@pytest.mark.parametrize(
    ("query", "seconds"),
    [(b"", 10.0), (b"seconds=2.5", 2.5), (b"x=1&seconds=300", 300.0), (b"seconds=1e-3", 1e-3)],
)
def test_capture_seconds_come_from_the_query(query: bytes, seconds: float) -> None:
    assert capture_seconds(query) == seconds


@pytest.mark.parametrize(
    "value",
    [
        b"0",
        b"-1",
        b"nan",
        b"abc",
        str(MAX_CAPTURE_S + 1).encode(),
        b"",
        b"1_0",
        b"%E2%80%AF1",
        b"inf",
    ],
)
def test_capture_seconds_out_of_range_are_invalid(value: bytes) -> None:
    """A blank value, "1_0" and a number in Unicode spaces were taken (the first two for
    10 s, the default)."""
    with pytest.raises(InvalidInput, match="expected seconds to capture"):
        capture_seconds(b"seconds=" + value)
    with pytest.raises(InvalidInput, match="expected seconds to capture"):
        capture_seconds(b"seconds")


def test_a_long_run_of_digits_is_refused_at_once() -> None:
    """Was: a backtracking pattern took 7 s on 16,000 digits and a bad character, on the
    event loop (a request target may be 64 KiB); on these ten it took minutes, past the
    suite's 120 s timeout."""
    for _ in range(10):
        with pytest.raises(InvalidInput):
            capture_seconds(b"seconds=" + b"1" * 60_000 + b"x")


def test_a_stage_never_reached_is_null_in_the_document() -> None:
    document = timeline_document("m", _trace(batch_closed_s=math.nan))
    assert document["model"] == "m"
    assert document["outcome"] == "expired"
    assert document["batch_closed_s"] is None
    assert document["arrived_s"] == 1.0 and document["answered_s"] == 2.0


def _trace(batch_closed_s: float = 1.5) -> RequestTrace:
    return RequestTrace(
        request_id=1,
        class_name="default",
        num_items=1,
        outcome=Outcome.EXPIRED,
        arrived_s=1.0,
        batch_closed_s=batch_closed_s,
        compute_started_s=math.nan,
        compute_ended_s=math.nan,
        answered_s=2.0,
        fill_wait_s=0.0,
        batch_size=0,
        replica_id=-1,
    )


def test_a_generation_request_lists_its_steps() -> None:
    trace = GenerationTrace(
        request_id=3,
        class_name="default",
        outcome="stop",
        num_prompt_tokens=4,
        num_generated=2,
        arrived_s=1.0,
        scheduled_s=1.1,
        first_token_s=1.2,
        answered_s=1.3,
        steps=((1.1, 1.2), (1.2, 1.25)),
    )
    document = timeline_document("llm", trace)
    assert document["kind"] == "generation"
    assert document["steps"] == [[1.1, 1.2], [1.2, 1.25]]
    assert (document["num_prompt_tokens"], document["num_generated"]) == (4, 2)
    assert timeline_document("m", _trace())["kind"] == "batch"


async def test_closing_the_hub_ends_a_capture_in_flight_with_what_it_holds(
    repository: ModelRepository,
) -> None:
    hub = TraceHub(repository)
    await repository.start()
    try:
        task = asyncio.ensure_future(capture(hub, MAX_CAPTURE_S))
        await asyncio.sleep(0)  # the capture runs to its first wait, subscribed
        assert hub.num_listeners == 1
        await _batcher(repository, "a").submit(np.float32(1))
        hub.close()
        document = await task
    finally:
        await repository.stop()
    assert document["seconds"] < MAX_CAPTURE_S
    assert [t["model"] for t in document["timelines"]] == ["a"]
    assert hub.num_listeners == 0
