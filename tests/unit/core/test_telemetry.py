"""Histograms and the telemetry snapshot, fed with hand-built requests and batches, and
read as a Prometheus exporter reads them (sums that never go down)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math

import numpy as np
import pytest

from carpool.core.request import Batch, Outcome, Request, RequestState, RequestTrace
from carpool.core.telemetry import (
    LATENCY_BUCKETS_S,
    REJECTION_REASONS,
    RING_SIZE,
    SLOWEST_WINDOW_S,
    Histogram,
    NullTelemetry,
    ReplicaCounters,
    Telemetry,
)

_ids = itertools.count()

# -- Histogram -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("size", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy_linear_interpolation(seed: int, size: int) -> None:
    values = np.random.default_rng(seed).exponential(0.01, size)
    histogram = Histogram()
    for value in values:
        histogram.observe(float(value))
    stats = histogram.stats()
    for got, q in [
        (stats.p50_s, 50),
        (stats.p90_s, 90),
        (stats.p99_s, 99),
        (stats.p999_s, 99.9),
    ]:
        assert got == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-15)
    assert stats.max_s == values.max()
    assert stats.mean_s == pytest.approx(values.mean())
    assert stats.count == size


def test_percentiles_of_known_values() -> None:
    histogram = Histogram()
    for value in [5.0, 1.0, 4.0, 2.0, 3.0]:
        histogram.observe(value)
    stats = histogram.stats()
    assert (stats.p50_s, stats.max_s, stats.mean_s) == (3.0, 5.0, 3.0)
    assert stats.p90_s == pytest.approx(4.6)


def test_empty_histogram_reports_nan_and_zero_counts() -> None:
    stats = Histogram().stats()
    assert stats.count == 0
    assert all(math.isnan(v) for v in (stats.mean_s, stats.p50_s, stats.p999_s, stats.max_s))
    assert all(count == 0 for _, count in stats.buckets)


def test_buckets_are_cumulative_with_inclusive_upper_bounds() -> None:
    histogram = Histogram(bounds=(1.0, 2.0, 5.0))
    for value in [0.5, 1.0, 1.5, 2.0, 2.0, 4.0, 9.0]:
        histogram.observe(value)
    assert histogram.stats().buckets == ((1.0, 2), (2.0, 5), (5.0, 6), (math.inf, 7))


def test_buckets_match_counting_by_hand_on_default_bounds() -> None:
    values = np.random.default_rng(3).lognormal(-5, 2, 500)
    histogram = Histogram()
    for value in values:
        histogram.observe(float(value))
    buckets = histogram.stats().buckets
    assert [bound for bound, _ in buckets] == [*LATENCY_BUCKETS_S, math.inf]
    for bound, count in buckets:
        assert count == int(np.sum(values <= bound))


def test_percentiles_cover_only_the_most_recent_samples_but_count_all() -> None:
    histogram = Histogram()
    for _ in range(RING_SIZE):
        histogram.observe(100.0)
    recent = np.linspace(0.0, 1.0, RING_SIZE)
    for value in recent:
        histogram.observe(float(value))
    stats = histogram.stats()
    assert stats.count == 2 * RING_SIZE
    assert stats.max_s == 1.0
    assert stats.p50_s == pytest.approx(np.percentile(recent, 50))
    assert stats.mean_s == pytest.approx((100.0 * RING_SIZE + recent.sum()) / (2 * RING_SIZE))
    assert stats.buckets[-1][1] == 2 * RING_SIZE


# -- Telemetry -----------------------------------------------------------------------------

SLOS = {"fast": 0.1, "bulk": None}


def _request(class_name: str = "fast", *, arrival_s: float = 0.0, num_items: int = 1) -> Request:
    return Request(
        request_id=next(_ids),
        payload=None,
        num_items=num_items,
        is_many=num_items > 1,
        cost=float(num_items),
        class_name=class_name,
        rank=0,
        arrival_s=arrival_s,
        deadline_s=None,
        future=asyncio.get_running_loop().create_future(),
    )


def _batch(requests: list[Request], max_batch_size: int, lead: str = "fast") -> Batch:
    return Batch(
        batch_id=next(_ids),
        requests=requests,
        num_items=sum(r.num_items for r in requests),
        cost=float(sum(r.num_items for r in requests)),
        lead_class=lead,
        max_batch_size=max_batch_size,
        closed_s=0.0,
    )


def _answer(
    telemetry: Telemetry,
    request: Request,
    outcome: Outcome,
    answered_s: float,
    closed_s: float | None = None,
) -> None:
    if closed_s is not None:
        request.batch_closed_s = closed_s
    telemetry.answered(request, outcome, answered_s)


async def test_counts_requests_items_and_outcomes_per_class() -> None:
    telemetry = Telemetry("m", SLOS)
    requests = [_request("fast"), _request("fast", num_items=3), _request("bulk")]
    for r in requests:
        telemetry.admitted(r)
    _answer(telemetry, requests[0], Outcome.OK, 0.05, closed_s=0.01)
    _answer(telemetry, requests[1], Outcome.MODEL_ERROR, 0.05)
    _answer(telemetry, requests[2], Outcome.CANCELLED, 0.05)
    telemetry.rejected("bulk", "queue_full")
    telemetry.rejected("nope", "invalid")  # unknown class: ignored, not an error
    snap = telemetry.snapshot(1.0, {"fast": 4, "bulk": 1}, [])
    fast, bulk = snap.classes["fast"], snap.classes["bulk"]
    assert (fast.num_requests, fast.num_items, fast.num_completed, fast.num_failed) == (2, 4, 1, 1)
    assert (bulk.num_requests, bulk.num_completed, bulk.num_failed) == (1, 0, 0)
    assert bulk.rejections == {"cancelled": 1, "queue_full": 1}
    assert (fast.num_pending, bulk.num_pending, snap.num_pending) == (4, 1, 5)
    assert fast.latency.count == 1
    assert fast.latency.max_s == pytest.approx(0.05)
    assert fast.queue_wait.max_s == pytest.approx(0.01)
    assert snap.latency.count == 1


async def test_rejections_are_counted_by_reason() -> None:
    telemetry = Telemetry("m", SLOS)
    _answer(telemetry, _request("bulk"), Outcome.EXPIRED, 1.0)
    _answer(telemetry, _request("bulk"), Outcome.EXPIRED, 1.0)
    _answer(telemetry, _request("bulk"), Outcome.CLOSED, 1.0)
    _answer(telemetry, _request("bulk"), Outcome.OUT_OF_MEMORY, 1.0)
    stats = telemetry.snapshot(1.0, {}, []).classes["bulk"]
    assert stats.rejections == {"deadline": 2, "closed": 1}
    assert stats.num_failed == 1


async def test_slo_attainment_counts_answered_in_time_over_answered_and_expired() -> None:
    telemetry = Telemetry("m", SLOS)  # fast: slo 0.1 s
    _answer(telemetry, _request(arrival_s=0.0), Outcome.OK, 0.05, closed_s=0.0)  # met
    _answer(telemetry, _request(arrival_s=0.0), Outcome.OK, 0.1, closed_s=0.0)  # met (<=)
    _answer(telemetry, _request(arrival_s=0.0), Outcome.OK, 0.3, closed_s=0.0)  # missed
    _answer(telemetry, _request(arrival_s=0.0), Outcome.EXPIRED, 0.2)  # missed
    _answer(telemetry, _request(arrival_s=0.0), Outcome.MODEL_ERROR, 0.01)  # not counted
    _answer(telemetry, _request(arrival_s=0.0), Outcome.CANCELLED, 0.01)  # not counted
    snap = telemetry.snapshot(1.0, {}, [])
    assert snap.classes["fast"].slo_attainment == pytest.approx(2 / 4)
    assert snap.classes["fast"].slo_s == 0.1


async def test_slo_attainment_is_none_without_slo_or_answers() -> None:
    telemetry = Telemetry("m", SLOS)
    _answer(telemetry, _request("bulk"), Outcome.OK, 1.0, closed_s=0.0)
    snap = telemetry.snapshot(1.0, {}, [])
    assert snap.classes["bulk"].slo_attainment is None
    assert snap.classes["fast"].slo_attainment is None


async def test_fill_ratio_is_mean_of_batch_size_over_max_batch_size() -> None:
    telemetry = Telemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    telemetry.batch_done(_batch([_request() for _ in range(8)], 8), replica, 0.1)
    telemetry.batch_done(_batch([_request() for _ in range(2)], 8), replica, 0.1)
    telemetry.batch_done(_batch([_request(num_items=3)], 4, lead="bulk"), replica, 0.1)
    batches = telemetry.snapshot(1.0, {}, [replica]).batches
    assert batches.fill_ratio == pytest.approx((1.0 + 0.25 + 0.75) / 3)
    assert batches.num_batches == 3
    assert batches.num_items == 13
    assert batches.mean_batch_size == pytest.approx(13 / 3)
    assert batches.size_histogram == {2: 1, 3: 1, 8: 1}
    assert batches.compute.count == 3


async def test_requests_expired_before_their_call_are_not_counted_as_batched() -> None:
    # settle.py expires the requests whose call's turn came past their deadline: the model
    # never saw them, so the batch ran without them, or, without any left, did not run.
    telemetry = Telemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    ran, late = _request(num_items=2), _request(num_items=3)
    late.state = RequestState.EXPIRED
    telemetry.batch_done(_batch([ran, late], 8), replica, 0.1)
    all_late = [_request(), _request()]
    for request in all_late:
        request.state = RequestState.EXPIRED
    telemetry.batch_done(_batch(all_late, 8), replica, 0.0)
    batches = telemetry.snapshot(1.0, {}, [replica]).batches
    assert (batches.num_batches, batches.num_items, batches.size_histogram) == (1, 2, {2: 1})
    assert batches.fill_ratio == pytest.approx(2 / 8)
    assert batches.compute.count == 1
    assert (replica.batches, replica.items) == (1, 2)


async def test_completed_batches_and_compute_are_counted_as_triton_does() -> None:
    # Triton: batch_stats only for executions with a success (execution_count), and each
    # successful request adds its execution's time to compute_infer.
    telemetry = Telemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    good = [_request(), _request(num_items=2)]
    batch = _batch(good, 8)
    batch.start(0, 0.0, None)
    for request in good:
        request.compute_start_s, request.compute_end_s = 0.25, 0.5
    telemetry.answered_ok(good, 0.5)  # one model call answered both
    telemetry.batch_done(batch, replica, 0.3)
    failed = _batch([_request()], 8)
    failed.start(0, 0.5, None)
    _answer(telemetry, failed.requests[0], Outcome.MODEL_ERROR, 0.75)
    telemetry.batch_done(failed, replica, 0.2)
    batches = telemetry.snapshot(1.0, {}, [replica]).batches
    assert batches.size_histogram == {1: 1, 3: 1}
    assert (batches.num_completed_batches, batches.num_completed_items) == (1, 3)
    assert batches.completed_size_histogram == {3: 1}
    assert batches.completed_size_compute_s == {3: pytest.approx(0.25)}
    assert batches.completed_compute_s == pytest.approx(2 * 0.25)


async def test_queue_of_a_successful_request_runs_to_its_call_s_start_as_triton_s() -> None:
    """Triton's ``queue``: arrival until the instance starts executing. Was: arrival to
    batch close, so a closed batch's wait behind a busy replica was in neither ``queue``
    nor ``compute_infer`` (316 of 1,873 ms of ``success`` in the review's run)."""
    telemetry = Telemetry("m", SLOS)
    requests = [_request(arrival_s=0.0), _request(arrival_s=0.1)]
    batch = _batch(requests, 8)
    batch.start(0, 0.2, None)  # closed at 0.2
    for request in requests:
        request.compute_start_s, request.compute_end_s = 0.5, 0.75  # behind the one before
    telemetry.answered_ok(requests, 0.75)
    batches = telemetry.snapshot(1.0, {}, []).batches
    assert batches.completed_queue_s == pytest.approx(0.5 + 0.4)
    assert batches.completed_queue_s + batches.completed_compute_s == pytest.approx(0.75 + 0.65)


async def test_a_split_batch_counts_each_call_that_succeeded_at_the_size_it_ran() -> None:
    # A batch of 4 that ran out of memory, then ran as two calls of 2 (settle.py): the
    # model never completed a batch of 4, it completed two of 2.
    telemetry = Telemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    requests = [_request() for _ in range(4)]
    batch = _batch(requests, 8)
    batch.start(0, 0.0, None)
    for part, (start_s, end_s) in zip(
        (requests[:2], requests[2:]), [(0.1, 0.3), (0.3, 0.4)], strict=True
    ):
        for request in part:
            request.compute_start_s, request.compute_end_s = start_s, end_s
        telemetry.answered_ok(part, end_s)
    telemetry.batch_done(batch, replica, 0.4)
    batches = telemetry.snapshot(1.0, {}, [replica]).batches
    assert batches.size_histogram == {4: 1}  # what the scheduler formed
    assert (batches.num_completed_batches, batches.num_completed_items) == (2, 4)
    assert batches.completed_size_histogram == {2: 2}
    assert batches.completed_size_compute_s == {2: pytest.approx(0.3)}
    assert batches.completed_compute_s == pytest.approx(2 * 0.2 + 2 * 0.1)


async def test_batches_led_are_counted_per_lead_class() -> None:
    telemetry = Telemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    telemetry.batch_done(_batch([_request()], 4, lead="bulk"), replica, 0.1)
    telemetry.batch_done(_batch([_request()], 4, lead="bulk"), replica, 0.1)
    telemetry.batch_done(_batch([_request()], 4, lead="fast"), replica, 0.1)
    classes = telemetry.snapshot(1.0, {}, [replica]).classes
    assert (classes["bulk"].num_batches_led, classes["fast"].num_batches_led) == (2, 1)


async def test_effective_compute_ratio_is_compute_over_compute_plus_fill_wait() -> None:
    telemetry = Telemetry("m", SLOS)
    first, second = ReplicaCounters(0, "cpu"), ReplicaCounters(1, "cpu")
    telemetry.batch_done(_batch([_request()], 4), first, 0.3)
    telemetry.batch_done(_batch([_request()], 4), second, 0.5)
    first.fill_wait_s = 0.1
    second.fill_wait_s = 0.1
    batches = telemetry.snapshot(2.0, {}, [first, second]).batches
    assert batches.effective_compute_ratio == pytest.approx(0.8 / 1.0)


async def test_ratios_are_zero_before_any_batch() -> None:
    batches = Telemetry("m", SLOS).snapshot(1.0, {}, [ReplicaCounters(0, "cpu")]).batches
    assert (batches.fill_ratio, batches.effective_compute_ratio) == (0.0, 0.0)
    assert batches.mean_batch_size == 0.0


async def test_replica_balance_is_least_busy_over_most_busy() -> None:
    telemetry = Telemetry("m", SLOS)
    replicas = [ReplicaCounters(i, f"cuda:{i}") for i in range(3)]
    for replica, busy_s in zip(replicas, [2.0, 4.0, 3.0], strict=True):
        telemetry.batch_done(_batch([_request()], 4), replica, busy_s)
    snap = telemetry.snapshot(10.0, {}, replicas)
    assert snap.replica_balance == pytest.approx(0.5)
    assert [r.busy_fraction for r in snap.replicas] == pytest.approx([0.2, 0.4, 0.3])
    assert [r.device for r in snap.replicas] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [(r.num_batches, r.num_items) for r in snap.replicas] == [(1, 1)] * 3


async def test_replica_balance_is_one_when_nothing_ran() -> None:
    replicas = [ReplicaCounters(0, "cpu"), ReplicaCounters(1, "cpu")]
    assert Telemetry("m", SLOS).snapshot(5.0, {}, replicas).replica_balance == 1.0


async def test_memory_volatility_is_peak_minus_trough_over_total() -> None:
    telemetry = Telemetry("m", SLOS)
    assert telemetry.snapshot(1.0, {}, []).memory is None
    for used in [400, 700, 300, 500]:
        telemetry.memory(used, 1000)
    memory = telemetry.snapshot(1.0, {}, []).memory
    assert memory is not None
    assert (memory.num_samples, memory.peak_bytes, memory.trough_bytes) == (4, 700, 300)
    assert memory.total_bytes == 1000
    assert memory.volatility == pytest.approx(0.4)


async def test_snapshot_carries_model_and_uptime() -> None:
    snap = Telemetry("resnet", SLOS).snapshot(12.5, {"fast": 0}, [])
    assert (snap.model, snap.uptime_s) == ("resnet", 12.5)
    assert set(snap.classes) == {"fast", "bulk"}


async def test_set_classes_adds_new_classes_and_keeps_old_counts() -> None:
    telemetry = Telemetry("m", SLOS)
    telemetry.admitted(_request("fast"))
    telemetry.set_classes({"fast": 0.2, "new": 1.0})
    telemetry.admitted(_request("new"))
    classes = telemetry.snapshot(1.0, {}, []).classes
    assert classes["fast"].num_requests == 1
    assert classes["fast"].slo_s == 0.2
    assert classes["new"].num_requests == 1


async def test_on_trace_gets_each_answered_request() -> None:
    traces: list[RequestTrace] = []
    telemetry = Telemetry("m", SLOS, on_trace=traces.append)
    request = _request(arrival_s=1.0)
    request.fill_wait_s = 0.02
    request.compute_start_s, request.compute_end_s = 1.05, 1.08
    _answer(telemetry, request, Outcome.OK, 1.1, closed_s=1.05)
    (trace,) = traces
    assert (trace.request_id, trace.outcome) == (request.request_id, Outcome.OK)
    assert trace.total_s == pytest.approx(0.1)
    assert trace.wait_s == pytest.approx(0.05)
    assert trace.queue_s == pytest.approx(0.03)
    assert trace.compute_s == pytest.approx(0.03)
    assert "compute 30.00 ms" in trace.describe()


async def test_snapshot_keeps_the_slowest_request_of_the_last_window() -> None:
    telemetry = Telemetry("m", SLOS)
    assert telemetry.snapshot(0.0, {}, []).slowest is None
    slow, fast = _request(arrival_s=0.0), _request(arrival_s=0.9)
    for request in (slow, fast):
        request.batch_closed_s = request.compute_start_s = 0.95
        request.compute_end_s = 1.0
    telemetry.answered_ok([slow, fast], 1.0)
    slowest = telemetry.snapshot(1.0, {}, []).slowest
    assert slowest is not None and slowest.request_id == slow.request_id
    assert slowest.wait_s == pytest.approx(0.95)
    # Past the window, the next one answered starts a new window, however fast it was.
    late = _request(arrival_s=1.0 + SLOWEST_WINDOW_S)
    late.batch_closed_s = late.compute_start_s = late.arrival_s
    late.compute_end_s = late.arrival_s + 0.01
    telemetry.answered_ok([late], late.compute_end_s + 0.01)
    slowest = telemetry.snapshot(20.0, {}, []).slowest
    assert slowest is not None and slowest.request_id == late.request_id


async def test_slow_requests_are_logged_with_where_the_time_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = Telemetry("m", SLOS, slow_request_s=0.5)
    with caplog.at_level(logging.WARNING, logger="carpool.slow"):
        _answer(telemetry, _request(arrival_s=0.0), Outcome.OK, 0.4, closed_s=0.1)
        _answer(telemetry, _request(arrival_s=0.0), Outcome.EXPIRED, 0.9)
    (record,) = caplog.records
    assert "slow request (m)" in record.getMessage()
    assert "without running" in record.getMessage()


async def test_null_telemetry_records_nothing_but_replica_busy_time() -> None:
    telemetry = NullTelemetry("m", SLOS)
    replica = ReplicaCounters(0, "cpu")
    request = _request()
    telemetry.admitted(request)
    telemetry.batch_done(_batch([request], 4), replica, 0.25)
    telemetry.answered(request, Outcome.OK, 1.0)
    snap = telemetry.snapshot(1.0, {}, [replica])
    assert snap.classes["fast"].num_requests == 0
    assert snap.batches.num_batches == 0
    assert snap.replicas[0].busy_s == 0.25


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("traced", [False, True])
async def test_answered_ok_counts_each_request_of_a_batch_in_its_class(
    seed: int, traced: bool
) -> None:
    """One call a batch: classes mixed in any order, each request counted in its own
    class (latency, queue wait, SLO), the batch once, a trace per request."""
    traces: list[RequestTrace] = []
    telemetry = Telemetry("m", SLOS, on_trace=traces.append if traced else None)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(int(rng.integers(5, 40))):
        arrival = float(rng.uniform(0, 1))
        request = _request(
            "fast" if rng.random() < 0.6 else "bulk",
            arrival_s=arrival,
            num_items=int(rng.integers(1, 4)),
        )
        request.batch_closed_s = arrival + float(rng.exponential(0.01))
        request.compute_start_s, request.compute_end_s = 2.0, 2.5
        request.batch_id, request.replica_id = 7, 0
        requests.append(request)
    now = 2.6
    telemetry.answered_ok(requests, now)
    snap = telemetry.snapshot(1.0, {}, [])
    for name in SLOS:
        mine = [r for r in requests if r.class_name == name]
        stats = snap.classes[name]
        assert stats.num_completed == stats.latency.count == stats.queue_wait.count == len(mine)
        assert stats.latency.sum_s == pytest.approx(sum(now - r.arrival_s for r in mine))
        waits = sum(r.batch_closed_s - r.arrival_s for r in mine)
        assert stats.queue_wait.sum_s == pytest.approx(waits)
        slo = SLOS[name]
        if slo is not None and mine:
            met = sum(now - r.arrival_s <= slo for r in mine)
            assert stats.slo_attainment == pytest.approx(met / len(mine))
    assert [t.request_id for t in traces] == [r.request_id for r in requests if traced]
    assert telemetry._ok_batches == 1  # one model call, however many requests
    assert telemetry._ok_items == sum(r.num_items for r in requests)


async def test_null_telemetry_answers_a_batch_without_counting_it() -> None:
    telemetry = NullTelemetry("m", SLOS)
    telemetry.answered_ok([_request(), _request("bulk")], 1.0)
    snap = telemetry.snapshot(1.0, {}, [])
    assert snap.classes["fast"].num_completed == 0
    assert snap.latency.count == 0


def test_histogram_sum_never_goes_down_as_zero_samples_arrive() -> None:
    # mean * count, recomputed per snapshot, drifts by an ulp either way; a Prometheus
    # _sum that goes down reads as a counter reset and makes rate() spike.
    histogram = Histogram()
    for value in (0.1, 0.2, 0.3):
        histogram.observe(value)
    sums = []
    for _ in range(40):
        sums.append(histogram.stats().sum_s)
        histogram.observe(0.0)  # an instant queue wait or a batch timed at 0 by the clock
    assert sums == sorted(sums)
    assert sums[-1] == 0.1 + 0.2 + 0.3


def test_merged_histograms_sum_their_totals() -> None:
    a, b = Histogram(), Histogram()
    a.observe(0.25)
    b.observe(0.5)
    b.observe(0.125)
    assert Histogram.merged([a, b]).sum_s == 0.875
    assert Histogram.merged([]).sum_s == 0.0


def test_rejection_reasons_are_sorted_and_unique() -> None:
    assert list(REJECTION_REASONS) == sorted(set(REJECTION_REASONS))


def test_stats_without_quantiles_keep_counts_buckets_and_sum() -> None:
    # /metrics needs no percentiles; skipping them skips the sort of the recent samples.
    histogram = Histogram()
    for value in (0.001, 0.02, 0.3, 4.0):
        histogram.observe(value)
    full, cheap = histogram.stats(), histogram.stats(quantiles=False)
    assert (cheap.count, cheap.buckets, cheap.sum_s) == (full.count, full.buckets, full.sum_s)
    assert full.max_s == 4.0
    assert math.isnan(cheap.p50_s) and math.isnan(cheap.p99_s) and math.isnan(cheap.max_s)
