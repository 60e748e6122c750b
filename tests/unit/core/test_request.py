"""A request's trace says where its time went, and the parts add up."""

from __future__ import annotations

import math

import pytest

from carpool.core.request import Outcome, RequestTrace


def _trace(**changes: float) -> RequestTrace:
    fields: dict[str, object] = {
        "request_id": 7,
        "class_name": "normal",
        "num_items": 1,
        "outcome": Outcome.OK,
        "arrived_s": 10.0,
        "batch_closed_s": 10.050,  # waited 50 ms, 5 of them with a replica holding it open
        "compute_started_s": 10.070,  # then 20 ms behind the replica's previous batch
        "compute_ended_s": 10.100,
        "answered_s": 10.101,
        "fill_wait_s": 0.005,
        "batch_size": 64,
        "replica_id": 0,
    }
    fields.update(changes)
    return RequestTrace(**fields)  # type: ignore[arg-type]


def test_parts_of_the_wait_add_up_to_the_total() -> None:
    trace = _trace()
    assert trace.queue_s == pytest.approx(0.045)
    assert trace.replica_wait_s == pytest.approx(0.020)
    assert trace.compute_s == pytest.approx(0.030)
    parts = trace.queue_s + trace.fill_wait_s + trace.replica_wait_s + trace.compute_s
    assert trace.total_s == pytest.approx(parts + 0.001)


def test_describe_names_each_part_in_milliseconds() -> None:
    text = _trace().describe()
    for fragment in (
        "request 7 [normal] ok in 101.00 ms",
        "queue 45.00 ms",
        "waiting for the batch to fill 5.00 ms",
        "behind the replica's previous batch 20.00 ms",
        "compute 30.00 ms (batch of 64 on replica 0)",
    ):
        assert fragment in text


def test_a_request_that_never_ran_says_so() -> None:
    trace = _trace(
        outcome=Outcome.EXPIRED,
        batch_closed_s=math.nan,
        compute_started_s=math.nan,
        compute_ended_s=math.nan,
        answered_s=10.2,
    )
    assert trace.describe() == "request 7 [normal] expired after 200.00 ms without running"
