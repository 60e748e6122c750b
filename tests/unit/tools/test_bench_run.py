"""``carpool bench`` run end to end on a tiny in-process model (``run_bench``), and what
its text table reports: the offered rate beside the achieved one, the warm-up kept out of
the measured schedule, time to first token for streams of one token; no full garbage
collection while a point runs."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from carpool.tools.bench import BenchConfig, Point, PointResult, full_collections_held, run_bench
from carpool.tools.benchreport import text_table
from carpool.tools.loadgen import (
    Arrival,
    ArrivalProcess,
    Mode,
    RateStep,
    RequestRecord,
    RunResult,
)
from carpool.tools.summary import summarize
from carpool.tools.targets import TargetSpec

MODULE = """
import numpy as np

def double(batch):
    return np.asarray(batch) * 2
"""


def _bench_config(point: Point, *, duration_s: float, warmup_s: float) -> BenchConfig:
    return BenchConfig(
        spec=TargetSpec(target="edgemodels:double", input_shape=(1, 4)),
        points=(point,),
        duration_s=duration_s,
        warmup_s=warmup_s,
        seed=3,
        drain_timeout_s=5.0,
        json_path=None,
        csv_path=None,
        plots_dir=None,
        show_progress=False,
    )


@pytest.fixture
def edgemodels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "edgemodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("edgemodels")
async def test_offered_rate_is_the_scheduled_requests_over_the_duration() -> None:
    # 100 req/s for 50 ms is 5 sends at 0, 10, ..., 40 ms: 100 req/s offered, not 5 / 40 ms.
    point = Point("rate=100", arrivals=ArrivalProcess.steady(100.0, Arrival.CONSTANT))
    [result] = await run_bench(_bench_config(point, duration_s=0.05, warmup_s=0.0))
    assert result.summary.num_requests == 5
    assert result.summary.offered_rate_rps == pytest.approx(100.0)


@pytest.mark.usefixtures("edgemodels")
async def test_the_warmup_does_not_change_the_measured_schedule() -> None:
    point = Point("rate=400", arrivals=ArrivalProcess.steady(400.0, Arrival.POISSON))
    counts = set()
    for warmup_s in (0.0, 0.01, 0.03):
        [result] = await run_bench(_bench_config(point, duration_s=0.05, warmup_s=warmup_s))
        counts.add(result.summary.num_requests)
    expected = len(ArrivalProcess.steady(400.0, Arrival.POISSON).send_times(
        0.05, np.random.default_rng(3)
    ))  # fmt: skip
    assert counts == {expected}


@pytest.mark.usefixtures("edgemodels")
async def test_a_schedule_starting_at_rate_0_warms_up_at_its_first_rate_above_0() -> None:
    """The docs allow a rate of 0; the warm-up took the first step alone, rate 0, and
    the run failed at once (refused as a schedule with no rate above 0)."""
    schedule = ArrivalProcess(Arrival.CONSTANT, (RateStep(0.0, 0.0), RateStep(0.02, 200.0)))
    point = Point("schedule", arrivals=schedule)
    [result] = await run_bench(_bench_config(point, duration_s=0.05, warmup_s=0.02))
    expected = schedule.send_times(0.05, np.random.default_rng(3))  # every 5 ms from 20 ms
    assert result.summary.num_requests == len(expected) > 0


def test_text_table_shows_the_offered_rate_next_to_the_achieved_one() -> None:
    records = [
        RequestRecord(i, i * 0.01, sent_s=i * 0.01, done_s=i * 0.01 + 0.5) for i in range(10)
    ]
    result = RunResult(Mode.OPEN, records, 0.0, 0.1, offered_rate_rps=100.0)
    summary = summarize(result)
    table = text_table([PointResult("rate=100", summary, None, [])])
    # 10 answers over 0.59 s: the server received less than was offered, and says so.
    assert summary.rate_rps == pytest.approx(10 / 0.59)
    assert "offered 100.0 req/s, achieved 16.9 req/s" in table


def test_text_table_shows_ttft_for_single_token_streams() -> None:
    records = [RequestRecord(i, 0.0, sent_s=0.0, done_s=0.1) for i in range(3)]
    for record in records:  # one token each: a first token, no gaps between tokens
        record.first_token_s, record.itl_s, record.num_tokens = 0.05, [], 1
    result = RunResult(Mode.CLOSED, records, 0.0, 0.1, concurrency=1)
    table = text_table([PointResult("c=1", summarize(result), None, [])])
    assert "ttft p50 50.00 ms" in table


def _full_collections_while(keep: list[object], num_lists: int) -> int:
    """Full (oldest-generation) collections run while ``num_lists`` long-lived lists are
    made and kept."""
    counted: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            counted.append(1)

    gc.callbacks.append(note)
    try:
        keep.extend([i] for i in range(num_lists))
    finally:
        gc.callbacks.remove(note)
    return len(counted)


def test_no_full_collection_runs_while_a_point_is_measured() -> None:
    """A full collection stalled the load generator's loop for about 100 ms mid-point,
    and its sends left late (counted against the server): while a point runs, only the
    young generations are collected; the threshold comes back after."""
    if not gc.isenabled():
        pytest.skip("the garbage collector is disabled in this process")
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's own, whatever this process had set
    try:
        # A full collection is due once the objects that survived into the oldest
        # generation since the last one pass a quarter of those that one found: collect
        # (the count starts again from what is alive now, not from what a test before
        # once held), then keep more than half as many as the process holds.
        gc.collect()
        num = 300_000 + len(gc.get_objects()) // 2
        kept: list[object] = []
        assert _full_collections_while(kept, num) > 0  # without the hold, some run
        with full_collections_held():
            assert gc.get_freeze_count() > 0  # what was alive before is not walked again
            assert _full_collections_while(kept, 2 * num) == 0
        assert gc.get_threshold() == (700, 10, 10)
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*threshold)
    # What the process itself froze stays frozen.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with full_collections_held():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
