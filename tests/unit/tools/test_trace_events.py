"""Request timelines as Chrome trace events (carpool.tools.trace_events): batches per
replica track, requests on lanes that never overlap, their stages, and flows."""

from __future__ import annotations

from typing import Any

import pytest

from carpool.tools.trace_events import (
    LANE_TID,
    REPLICA_TID,
    Timeline,
    chrome_trace,
    timeline_from_dict,
)


def _timeline(request_id: int, arrived_s: float, **changes: Any) -> Timeline:
    values: dict[str, Any] = {
        "model": "m",
        "request_id": request_id,
        "class_name": "default",
        "outcome": "ok",
        "num_items": 1,
        "batch_size": 2,
        "replica_id": 0,
        "fill_wait_s": 0.001,
        "arrived_s": arrived_s,
        "batch_closed_s": 1.010,
        "compute_started_s": 1.011,
        "compute_ended_s": 1.020,
        "answered_s": 1.021,
    }
    return Timeline(**{**values, **changes})


def _events(*timelines: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = chrome_trace(timelines, metadata={})["traceEvents"]
    return events


def test_requests_of_one_batch_make_one_slice_on_their_replica_track() -> None:
    events = _events(
        _timeline(1, 1.000),
        _timeline(2, 1.005),
        _timeline(3, 1.030, replica_id=1, compute_started_s=1.031, compute_ended_s=1.04,
                  batch_closed_s=1.030, answered_s=1.041),
    )  # fmt: skip
    batches = [e for e in events if e.get("cat") == "batch"]
    assert [(b["tid"], b["args"]["request_ids"]) for b in batches] == [
        (REPLICA_TID, [1, 2]),
        (REPLICA_TID + 1, [3]),
    ]
    assert batches[0]["ts"] == 11_000.0 and batches[0]["dur"] == 9_000.0  # µs from 1.000 s
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[REPLICA_TID] == "replica 0" and names[REPLICA_TID + 1] == "replica 1"


def test_overlapping_requests_take_separate_lanes_and_a_free_lane_is_reused() -> None:
    events = _events(
        _timeline(1, 1.000),
        _timeline(2, 1.005),  # overlaps 1: a second lane
        _timeline(3, 1.025, batch_closed_s=1.03, compute_started_s=1.03,
                  compute_ended_s=1.04, answered_s=1.05),  # after both: lane 0 again
    )  # fmt: skip
    lanes = {int(e["name"].split()[1]): e["tid"] for e in events if e.get("cat") == "request"}
    assert lanes == {1: LANE_TID, 2: LANE_TID + 1, 3: LANE_TID}


def test_a_request_is_split_into_its_stages() -> None:
    events = _events(_timeline(1, 1.000))
    stages = [(e["name"], e["ts"], e["dur"]) for e in events if e.get("cat") == "stage"]
    assert stages == [
        ("queue", 0.0, 9_000.0),
        ("fill wait", 9_000.0, 1_000.0),
        ("replica wait", 10_000.0, 1_000.0),
        ("compute", 11_000.0, 9_000.0),
        ("answer", 20_000.0, 1_000.0),
    ]
    [request] = [e for e in events if e.get("cat") == "request"]
    assert request["args"]["compute_ms"] == pytest.approx(9.0)


def test_each_batched_request_flows_into_its_batch() -> None:
    events = _events(_timeline(1, 1.000))
    start, end = (e for e in events if e["ph"] in "sf")
    assert (start["ph"], start["tid"], end["ph"], end["tid"]) == ("s", LANE_TID, "f", REPLICA_TID)
    assert start["id"] == end["id"] == "m/1"
    assert end["bp"] == "e"
    [batch] = [e for e in events if e.get("cat") == "batch"]
    assert batch["ts"] < end["ts"] < batch["ts"] + batch["dur"]


def test_a_request_that_expired_in_its_queue_has_no_batch_and_no_flow() -> None:
    expired = _timeline(
        1, 1.000, outcome="expired", batch_closed_s=None, compute_started_s=None,
        compute_ended_s=None, replica_id=-1, answered_s=1.5,
    )  # fmt: skip
    events = _events(expired)
    assert not [e for e in events if e.get("cat") == "batch" or e["ph"] in "sf"]
    stages = [(e["name"], e["dur"]) for e in events if e.get("cat") == "stage"]
    assert stages == [("queue", 500_000.0)]


def test_models_are_processes() -> None:
    events = _events(_timeline(1, 1.0, model="b"), _timeline(1, 1.0, model="a"))
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {1: "model a", 2: "model b"}
    flows = {e["id"] for e in events if e["ph"] == "s"}
    assert flows == {"a/1", "b/1"}


def test_a_timeline_reads_the_servers_json() -> None:
    document = {
        "model": "m", "request_id": 4, "class_name": "c", "outcome": "ok", "num_items": 2,
        "batch_size": 2, "replica_id": 0, "fill_wait_s": None, "arrived_s": 1.0,
        "batch_closed_s": 1.1, "compute_started_s": None, "compute_ended_s": None,
        "answered_s": 1.2,
    }  # fmt: skip
    timeline = Timeline.from_dict(document)
    assert timeline.fill_wait_s == 0.0
    assert not timeline.has_run
    assert [name for name, _, _ in timeline.stages()] == ["queue", "answer"]


def _generation(request_id: int, arrived_s: float, steps: list[tuple[float, float]]) -> Any:
    return timeline_from_dict(
        {
            "model": "llm", "kind": "generation", "request_id": request_id,
            "class_name": "default", "outcome": "length", "num_prompt_tokens": 3,
            "num_generated": len(steps), "arrived_s": arrived_s, "scheduled_s": steps[0][0],
            "first_token_s": steps[0][1], "answered_s": steps[-1][1] + 0.001,
            "steps": [list(step) for step in steps],
        }
    )  # fmt: skip


def test_generation_steps_are_slices_on_the_engine_track_shared_by_their_requests() -> None:
    events = _events(
        _generation(1, 1.000, [(1.001, 1.002), (1.002, 1.003), (1.003, 1.004)]),
        _generation(2, 1.0015, [(1.002, 1.003), (1.003, 1.004)]),
    )
    steps = [
        (e["tid"], e["ts"], e["args"]["request_ids"]) for e in events if e.get("cat") == "step"
    ]
    assert steps == [
        (REPLICA_TID, 1_000.0, [1]),
        (REPLICA_TID, 2_000.0, [1, 2]),
        (REPLICA_TID, 3_000.0, [1, 2]),
    ]
    first = [e["name"] for e in events if e.get("cat") == "stage" and e["tid"] == LANE_TID]
    assert first == ["queue", "prefill", "decode", "decode"]
    flow_ends = sorted(e["ts"] for e in events if e["ph"] == "f")
    assert flow_ends == [1_000.5, 2_000.5]  # each request to its first step
