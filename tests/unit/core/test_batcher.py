"""Behaviour of :class:`carpool.Batcher`, driven through its public methods.

Time is a FakeClock: batches close only when a test advances it (or when a size limit
is reached). Most models are async fakes that run on the loop, so each step is
deterministic; a few tests use a sync model blocked on a ``threading.Event`` to check
what happens off the loop.

Behaviour with a module of its own is tested there: failures in test_settle.py, replica
loops in test_dispatch.py, start and stop in test_lifecycle.py, policy updates in
test_policy_update.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from carpool import (
    Batcher,
    BatchPolicy,
    ClassPolicy,
    Closed,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    QueueFull,
    RequestTrace,
)
from carpool.core.clock import FakeClock, settle
from carpool.core.request import Outcome

from .conftest import SAFETY_S, finish, occupy

THREE_CLASSES = (ClassPolicy("interactive"), ClassPolicy("normal"), ClassPolicy("background"))


# -- closing batches: size, delay, preferred sizes, cost ----------------------------------


async def test_flushes_when_max_batch_size_reached(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(max_batch_size=4, max_delay_s=10.0)
    await batcher.start()

    tasks = [spawn(batcher.submit(i)) for i in range(4)]
    await settle()

    assert fake_model.batches == [[0, 1, 2, 3]]
    assert fake_clock.now() == 1000.0
    assert [t.result() for t in tasks] == [0, 10, 20, 30]


async def test_batches_never_exceed_max_batch_size(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(max_batch_size=4, max_delay_s=10.0)
    await batcher.start()

    tasks = [spawn(batcher.submit(i)) for i in range(10)]
    await settle()
    assert fake_model.sizes == [4, 4]
    assert batcher.num_pending == 2

    await fake_clock.advance(10.0)
    assert fake_model.sizes == [4, 4, 2]
    assert [t.result() for t in tasks] == [i * 10 for i in range(10)]


async def test_max_delay_counts_from_the_oldest_waiting_request(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=8, max_delay_s=1.0)
    await batcher.start()

    first = spawn(batcher.submit("r1"))
    await fake_clock.advance(0.5)
    second = spawn(batcher.submit("r2"))
    await fake_clock.advance(0.25)
    assert fake_model.batches == []
    assert not first.done()

    await fake_clock.advance(0.25)  # t + max_delay_s, where t is r1's arrival
    assert fake_model.batches == [["r1", "r2"]]
    assert fake_model.started_at == [1001.0]
    assert (first.result(), second.result()) == ("r1" * 10, "r2" * 10)


async def test_nothing_runs_before_max_delay_when_the_batch_is_not_full(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=8, max_delay_s=1.0)
    task = spawn(batcher.submit(1))
    await fake_clock.advance(0.875)
    assert fake_model.batches == []
    assert batcher.num_pending == 1

    await fake_clock.advance(0.125)
    assert fake_model.batches == [[1]]
    assert task.result() == 10


@pytest.mark.parametrize(
    ("queued", "sent_at_once"),
    [(3, None), (5, 4), (7, 4), (9, 8), (16, 16)],
)
async def test_free_replica_sends_the_largest_preferred_size_the_queue_fills(
    make_batcher, fake_model, fake_clock, spawn, queued, sent_at_once
):
    batcher = make_batcher(max_batch_size=16, max_delay_s=10.0, preferred_batch_sizes=(4, 8))
    await occupy(batcher, fake_model, spawn, fake_clock)
    for i in range(queued):
        spawn(batcher.submit(i))
    await settle()

    fake_model.release()
    await settle()

    after_blocker = fake_model.sizes[1:]
    assert after_blocker == ([] if sent_at_once is None else [sent_at_once])
    assert batcher.num_pending == queued - (sent_at_once or 0)


async def test_batches_stay_within_max_batch_cost(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(
        collate="list", cost_fn=len, max_batch_cost=10, max_batch_size=16, max_delay_s=1.0
    )
    await occupy(batcher, fake_model, spawn, fake_clock, blocker="z")
    words = ["aaaa", "bbb", "cc", "ddddd", "eeeeee", "f"]
    tasks = [spawn(batcher.submit(w)) for w in words]
    await settle()

    fake_model.release()
    await settle()
    assert fake_model.batches[1:] == [["aaaa", "bbb", "cc"], ["ddddd"]]

    await fake_clock.advance(1.0)
    assert fake_model.batches[1:] == [["aaaa", "bbb", "cc"], ["ddddd"], ["eeeeee", "f"]]
    assert all(sum(map(len, b)) <= 10 for b in fake_model.batches[1:])
    assert [t.result() for t in tasks] == [w * 10 for w in words]


async def test_request_costing_more_than_the_budget_is_rejected_at_submit(make_batcher):
    batcher = make_batcher(collate="list", cost_fn=len, max_batch_cost=10)

    with pytest.raises(InvalidInput, match="max_batch_cost"):
        await batcher.submit("x" * 11)

    assert batcher.num_pending == 0
    assert batcher.snapshot().classes["normal"].rejections == {"invalid": 1}


async def test_cost_keyword_overrides_cost_fn(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(
        collate="list", cost_fn=len, max_batch_cost=10, max_batch_size=16, max_delay_s=1.0
    )
    with pytest.raises(InvalidInput, match="max_batch_cost"):
        await batcher.submit("x", cost=11)

    a = spawn(batcher.submit("a", cost=6))
    b = spawn(batcher.submit("b", cost=6))
    long = spawn(batcher.submit("y" * 12, cost=1))
    await settle()
    assert fake_model.batches == [["a"]]  # closed at once: "b" would break the budget

    await fake_clock.advance(1.0)
    assert fake_model.batches == [["a"], ["b", "y" * 12]]
    assert (a.result(), b.result(), long.result()) == ("a" * 10, "b" * 10, "y" * 120)


async def test_numpy_integer_cost_is_accepted(make_batcher, spawn):
    """cost=array.sum() or np.prod(shape) is a NumPy integer: a valid finite cost."""
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    payload = np.ones(3)
    task = spawn(batcher.submit(payload, cost=np.int64(3)))
    await settle()
    np.testing.assert_array_equal(await asyncio.wait_for(task, SAFETY_S), payload * 10)


# -- admission: queue bounds, deadlines --------------------------------------------------


async def test_global_max_queue_size_raises_queue_full_at_once(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_queue_size=2, max_delay_s=0.0)
    blocker = await occupy(batcher, fake_model, spawn, fake_clock)
    queued = [spawn(batcher.submit(i)) for i in (1, 2)]
    await settle()

    with pytest.raises(QueueFull) as caught:
        await batcher.submit(3)

    assert caught.value.limit == 2
    assert batcher.snapshot().classes["normal"].rejections == {"queue_full": 1}
    fake_model.release()
    await settle()
    assert [t.result() for t in (blocker, *queued)] == [-10, 10, 20]
    assert 3 not in [x for b in fake_model.batches for x in b]


async def test_class_max_queue_size_bounds_only_that_class(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(
        classes=(ClassPolicy("interactive", max_queue_size=1), ClassPolicy("normal")),
        max_delay_s=0.0,
    )
    await occupy(batcher, fake_model, spawn, fake_clock)
    spawn(batcher.submit(1, priority="interactive"))
    await settle()

    with pytest.raises(QueueFull) as caught:
        await batcher.submit(2, priority="interactive")
    spawn(batcher.submit(3, priority="normal"))
    await settle()

    assert caught.value.queue == "interactive"
    assert batcher.num_pending == 2
    classes = batcher.snapshot().classes
    assert classes["interactive"].rejections == {"queue_full": 1}
    assert classes["normal"].rejections == {}


async def test_request_expires_while_queued_and_never_reaches_the_model(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    task = spawn(batcher.submit(7, timeout_s=0.5))
    await fake_clock.advance(0.25)
    assert not task.done()

    await fake_clock.advance(0.25)
    assert task.done()
    with pytest.raises(DeadlineExceeded) as caught:
        task.result()
    assert caught.value.timeout_s == 0.5

    fake_model.release()
    await settle()
    assert fake_model.batches == [[-1]]
    assert batcher.snapshot().classes["normal"].rejections == {"deadline": 1}


async def test_deadline_counts_from_the_arrival_given(make_batcher, fake_model, fake_clock, spawn):
    # A server passes when the request's first byte came: time spent reading and
    # parsing it counts against its timeout.
    batcher = make_batcher(max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    task = spawn(batcher.submit(7, timeout_s=0.5, arrival_s=fake_clock.now() - 0.4))
    await fake_clock.advance(0.1)
    assert isinstance(task.exception(), DeadlineExceeded)
    assert batcher.snapshot().classes["normal"].rejections == {"deadline": 1}


async def test_an_arrival_in_the_future_counts_as_now(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    task = spawn(batcher.submit(7, timeout_s=0.5, arrival_s=fake_clock.now() + 60.0))
    await fake_clock.advance(0.5)
    assert isinstance(task.exception(), DeadlineExceeded)


async def test_request_that_would_finish_past_its_deadline_is_not_run(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.0)
    for _ in range(2):  # the first batch of a size is cold, and not learned
        blocker = await occupy(batcher, fake_model, spawn, fake_clock)
        await fake_clock.advance(0.3)  # batches of one take 0.3 s on this model
        fake_model.release()
        await finish(blocker)
        fake_model.hold()
    late = spawn(batcher.submit(1, timeout_s=0.2))
    on_time = spawn(batcher.submit(2, timeout_s=1.0))
    await settle()
    # Answered at once, not after its deadline; the model never saw it.
    assert isinstance(late.exception(), DeadlineExceeded)
    assert late.exception().left_s == pytest.approx(0.2)  # it says so: not "waited"
    assert fake_model.batches[2:] == [[2]]
    fake_model.release()
    assert await finish(on_time) == [20]


async def test_a_slow_first_batch_does_not_shut_out_later_requests(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.0)
    cold = await occupy(batcher, fake_model, spawn, fake_clock)
    await fake_clock.advance(0.9)  # the first batch of a shape: kernels chosen, caches cold
    fake_model.release()
    await finish(cold)
    task = spawn(batcher.submit(3, timeout_s=0.5))
    await settle()
    assert await finish(task) == [30]  # not expired on the word of that one cold batch


async def test_class_timeout_is_the_default_deadline(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(classes=(ClassPolicy("normal", timeout_s=0.25),), max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    defaulted = spawn(batcher.submit(1))
    explicit = spawn(batcher.submit(2, timeout_s=1.0))

    await fake_clock.advance(0.25)

    assert isinstance(defaulted.exception(), DeadlineExceeded)
    assert defaulted.exception().timeout_s == 0.25
    assert not explicit.done()
    fake_model.release()
    await settle()
    assert explicit.result() == 20


async def test_policy_timeout_is_the_default_deadline(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(timeout_s=0.5, max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    task = spawn(batcher.submit(1))
    await fake_clock.advance(0.5)
    assert isinstance(task.exception(), DeadlineExceeded)


@pytest.mark.parametrize("timeout_s", [0, -1.0, math.nan, math.inf, "1", True])
async def test_invalid_timeout_is_rejected(make_batcher, timeout_s):
    batcher = make_batcher()
    with pytest.raises(InvalidInput, match="timeout_s"):
        await batcher.submit(1, timeout_s=timeout_s)
    assert batcher.num_pending == 0
    assert batcher.snapshot().classes["normal"].rejections == {"invalid": 1}


# -- cancellation -------------------------------------------------------------------------


async def test_cancelled_while_queued_is_dropped_and_the_rest_of_the_batch_succeeds(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    one, two, three = (spawn(batcher.submit(i)) for i in (1, 2, 3))
    await settle()

    two.cancel()
    await settle()
    assert batcher.num_pending == 2
    fake_model.release()
    await settle()

    assert fake_model.batches == [[-1], [1, 3]]
    assert two.cancelled()
    assert (one.result(), three.result()) == (10, 30)
    assert batcher.snapshot().classes["normal"].rejections == {"cancelled": 1}


async def test_cancelled_while_running_lets_the_batch_finish_for_the_others(
    make_batcher, fake_model, fake_clock, spawn, loop_errors
):
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    fake_model.hold()
    one, two = spawn(batcher.submit(1)), spawn(batcher.submit(2))
    await settle()
    assert fake_model.batches == [[1, 2]]

    one.cancel()
    await settle()
    fake_model.release()
    await settle()

    assert one.cancelled()
    assert two.result() == 20
    assert batcher.snapshot().classes["normal"].rejections == {}
    assert loop_errors == []


# -- priority classes ---------------------------------------------------------------------


async def test_higher_classes_lead_the_next_batches(make_batcher, fake_model, fake_clock, spawn):
    batcher = make_batcher(
        classes=THREE_CLASSES, fill_from_lower=False, max_delay_s=0.0, max_batch_size=4
    )
    await occupy(batcher, fake_model, spawn, fake_clock)
    for name, priority in [("b1", "background"), ("n1", "normal"), ("i1", "interactive")]:
        spawn(batcher.submit(name, priority=priority))
    await settle()

    fake_model.release()
    await settle()

    assert fake_model.batches[1:] == [["i1"], ["n1"], ["b1"]]


async def test_fill_from_lower_fills_leftover_room_with_lower_classes(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(
        classes=THREE_CLASSES, fill_from_lower=True, max_delay_s=0.0, max_batch_size=3
    )
    await occupy(batcher, fake_model, spawn, fake_clock)
    arrivals = [("b1", "background"), ("b2", "background"), ("n1", "normal"), ("i1", "interactive")]
    for name, priority in arrivals:
        spawn(batcher.submit(name, priority=priority))
    await settle()

    fake_model.release()
    await settle()

    assert fake_model.batches[1:] == [["i1", "n1", "b1"], ["b2"]]


@pytest.mark.parametrize(("waited_s", "first"), [(1.0, ["i1", "i2"]), (2.0, ["b1"])])
async def test_request_waiting_past_max_wait_goes_before_younger_higher_classes(
    make_batcher, fake_model, fake_clock, spawn, waited_s, first
):
    batcher = make_batcher(
        classes=(
            ClassPolicy("interactive"),
            ClassPolicy("normal"),
            ClassPolicy("background", max_wait_s=2.0),
        ),
        fill_from_lower=False,
        max_delay_s=0.0,
    )
    await occupy(batcher, fake_model, spawn, fake_clock)
    spawn(batcher.submit("b1", priority="background"))
    await fake_clock.advance(waited_s)
    for name in ("i1", "i2"):
        spawn(batcher.submit(name, priority="interactive"))
    await settle()

    fake_model.release()
    await settle()

    assert fake_model.batches[1] == first
    assert sorted(x for b in fake_model.batches[1:] for x in b) == ["b1", "i1", "i2"]


async def test_aged_lower_class_does_not_starve_an_older_higher_class_request(
    make_batcher, fake_model, fake_clock, spawn
):
    # Aging exists so that no class starves. An aged "normal" request goes before every
    # *younger* request, but an "interactive" request that has waited even longer must
    # not be passed over: under a sustained normal backlog every normal head is aged, and
    # interactive (which never ages) would otherwise never run again.
    classes = (ClassPolicy("interactive"), ClassPolicy("normal", max_wait_s=1.0))
    batcher = make_batcher(
        max_batch_size=1, max_delay_s=0.0, classes=classes, fill_from_lower=False
    )
    await batcher.start()
    fake_model.hold()
    blocker = spawn(batcher.submit(0, priority="normal"))
    await settle()
    assert fake_model.running == 1  # the one replica is busy from now on

    interactive = spawn(batcher.submit(1, priority="interactive"))
    await fake_clock.advance(0.5)
    backlog = [spawn(batcher.submit(i, priority="normal")) for i in (2, 3)]
    await fake_clock.advance(1.5)  # the normal backlog is aged; interactive is older still

    fake_model.release()
    await finish(blocker, interactive, *backlog)
    order = [batch[0] for batch in fake_model.batches]
    assert order == [0, 1, 2, 3]


@pytest.mark.parametrize(("share", "running_at_once"), [(0.5, 1), (1.0, 2)])
async def test_share_limits_batches_a_class_leads_at_once(
    make_batcher, fake_model, spawn, share, running_at_once
):
    batcher = make_batcher(
        num_replicas=2,
        classes=(ClassPolicy("normal"), ClassPolicy("background", share=share)),
        max_batch_size=1,
        max_delay_s=0.0,
    )
    await batcher.start()
    fake_model.hold()
    background = [spawn(batcher.submit(i, priority="background")) for i in (1, 2)]
    await settle()
    assert fake_model.running == running_at_once

    normal = spawn(batcher.submit(3))
    await settle()
    assert fake_model.running == 2  # the class cap leaves the other replica to others

    fake_model.release()
    await settle()
    assert [t.result() for t in (*background, normal)] == [10, 20, 30]


# -- submit_many --------------------------------------------------------------------------


async def test_submit_many_counts_every_item_toward_max_batch_size(make_batcher, spawn):
    batcher = make_batcher(max_batch_size=4, max_delay_s=10.0)
    many = spawn(batcher.submit_many(np.arange(6.0).reshape(3, 2)))
    single = spawn(batcher.submit(np.array([7.0, 8.0])))
    await settle()  # 3 + 1 items fill the batch: no delay needed

    np.testing.assert_array_equal(many.result(), np.arange(6.0).reshape(3, 2) * 10)
    np.testing.assert_array_equal(single.result(), [70.0, 80.0])


async def test_submit_many_that_does_not_fit_waits_for_the_next_batch(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=4, max_delay_s=10.0)
    three = spawn(batcher.submit_many(np.ones((3, 2))))
    two = spawn(batcher.submit_many(np.ones((2, 2))))
    await settle()
    assert fake_model.sizes == [3]

    await fake_clock.advance(10.0)
    assert fake_model.sizes == [3, 2]
    assert (len(three.result()), len(two.result())) == (3, 2)


async def test_submit_many_with_a_list_returns_exactly_its_outputs(make_batcher, spawn):
    batcher = make_batcher(collate="list", max_batch_size=4, max_delay_s=10.0)
    many = spawn(batcher.submit_many(["a", "b", "c"]))
    single = spawn(batcher.submit("d"))
    await settle()
    assert many.result() == ["a" * 10, "b" * 10, "c" * 10]
    assert single.result() == "d" * 10


@pytest.mark.parametrize(
    ("payload", "match"),
    [(np.ones((5, 2)), "max_batch_size"), (np.ones((0, 2)), "0 items")],
    ids=["too_many", "empty"],
)
async def test_submit_many_rejects_bad_item_counts(make_batcher, payload, match):
    batcher = make_batcher(max_batch_size=4)
    with pytest.raises(InvalidInput, match=match):
        await batcher.submit_many(payload)
    assert batcher.num_pending == 0


# -- telemetry ----------------------------------------------------------------------------


async def test_snapshot_counts_requests_and_batch_sizes(make_batcher, fake_clock, spawn):
    batcher = make_batcher(max_batch_size=4, max_delay_s=1.0)
    tasks = [spawn(batcher.submit(i)) for i in range(6)]
    await settle()
    await fake_clock.advance(1.0)
    await finish(*tasks)

    snap = batcher.snapshot()
    normal = snap.classes["normal"]
    assert (normal.num_requests, normal.num_completed, normal.num_failed) == (6, 6, 0)
    assert snap.classes["interactive"].num_requests == 0
    assert snap.batches.num_batches == 2
    assert snap.batches.size_histogram == {2: 1, 4: 1}
    assert snap.batches.mean_batch_size == 3.0
    assert snap.batches.fill_ratio == pytest.approx((4 / 4 + 2 / 4) / 2)


async def _two_timed_requests(batcher: Batcher, model: Any, clock: FakeClock, spawn: Any) -> None:
    """r1 arrives at 0 on an idle replica, its batch closes at 0.25 (max_delay_s) and
    computes until 1.0; r2 arrives at 0.5 behind it and runs at 1.0 in no time.

    r1: fill wait 0.25, queue 0, compute 0.75, total 1.0; r2: queue 0.5, total 0.5.
    """
    await batcher.start()
    await settle()
    model.hold()
    r1 = spawn(batcher.submit(1))
    await clock.advance(0.25)
    assert model.running == 1
    await clock.advance(0.25)
    r2 = spawn(batcher.submit(2))
    await clock.advance(0.5)
    model.release()
    await settle()
    assert (r1.result(), r2.result()) == (10, 20)


async def test_trace_hook_sees_where_each_requests_time_went(
    make_batcher, fake_model, fake_clock, spawn
):
    traces: list[RequestTrace] = []
    batcher = make_batcher(max_delay_s=0.25, on_trace=traces.append)
    await _two_timed_requests(batcher, fake_model, fake_clock, spawn)

    first, second = traces
    assert first.outcome is Outcome.OK
    assert (first.fill_wait_s, first.queue_s, first.compute_s, first.total_s) == pytest.approx(
        (0.25, 0.0, 0.75, 1.0)
    )
    assert (first.batch_size, first.replica_id) == (1, 0)
    assert (second.fill_wait_s, second.queue_s, second.compute_s, second.total_s) == pytest.approx(
        (0.0, 0.5, 0.0, 0.5)
    )


async def test_raising_on_trace_hook_does_not_strand_the_batch(
    make_batcher, spawn, caplog, loop_errors
):
    def hook(trace: object) -> None:
        raise RuntimeError("bug in the hook")

    batcher = make_batcher(max_batch_size=2, max_delay_s=10.0, on_trace=hook)
    with caplog.at_level(logging.ERROR, logger="carpool"):
        first = [spawn(batcher.submit(i)) for i in range(2)]
        await settle()
        assert all(t.done() for t in first), "every request of the batch is answered"
        later = [spawn(batcher.submit(i)) for i in range(2, 4)]
        await settle()
    assert [t.result() for t in first + later] == [0, 10, 20, 30]
    assert "on_trace" in caplog.text
    await batcher.stop()
    assert loop_errors == []


async def test_snapshot_reports_latency_percentiles_and_effective_compute_ratio(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.25)
    await _two_timed_requests(batcher, fake_model, fake_clock, spawn)

    snap = batcher.snapshot()
    latency = snap.classes["normal"].latency
    assert latency.count == 2
    assert (latency.p50_s, latency.max_s) == pytest.approx((0.75, 1.0))
    assert snap.classes["normal"].queue_wait.max_s == pytest.approx(0.5)
    # 0.75 s of compute against 0.25 s of a replica idling while the batch filled
    assert 0.0 <= snap.batches.effective_compute_ratio <= 1.0
    assert snap.batches.effective_compute_ratio == pytest.approx(0.75)


async def test_snapshot_without_quantiles_keeps_every_count(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.25)
    await _two_timed_requests(batcher, fake_model, fake_clock, spawn)

    full, cheap = batcher.snapshot(), batcher.snapshot(quantiles=False)
    for stats in (cheap.classes["normal"].latency, cheap.batches.compute):
        assert math.isnan(stats.p50_s) and math.isnan(stats.max_s)
    assert cheap.classes["normal"].latency.buckets == full.classes["normal"].latency.buckets
    assert cheap.classes["normal"].latency.sum_s == pytest.approx(1.5)  # 1.0 s + 0.5 s
    assert cheap.batches == replace(full.batches, compute=cheap.batches.compute)


def double(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


async def test_a_snapshot_without_quantiles_sorts_no_samples_for_the_merged_latency() -> None:
    # /metrics asks for quantiles=False so that a scrape does not sort the recent samples;
    # the all-classes latency sorted up to 3 x 8192 of them anyway, on every scrape.
    clock = FakeClock()
    batcher = Batcher(double, BatchPolicy(max_batch_size=4, max_delay_s=0.0), clock=clock)
    await batcher.start()
    try:
        for _ in range(3):
            await batcher.submit_many({"x": np.ones((1, 2), np.float32)})
    finally:
        await batcher.stop()
    cheap = batcher.snapshot(quantiles=False)
    assert cheap.latency.count == 3  # counts and sums are still there
    assert math.isnan(cheap.latency.p50_s) and math.isnan(cheap.latency.max_s)
    assert not math.isnan(batcher.snapshot().latency.p50_s)


async def test_slo_attainment_is_the_share_answered_within_slo(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(classes=(ClassPolicy("normal", slo_s=0.5),), max_delay_s=0.25)
    await _two_timed_requests(batcher, fake_model, fake_clock, spawn)

    stats = batcher.snapshot().classes["normal"]
    assert stats.slo_s == 0.5
    assert stats.slo_attainment == pytest.approx(0.5)  # r2 in 0.5 s, r1 in 1.0 s


async def test_slow_requests_are_logged_to_carpool_slow(
    make_batcher, fake_model, fake_clock, spawn, caplog
):
    batcher = make_batcher(max_delay_s=0.25, slow_request_s=0.75)
    with caplog.at_level(logging.WARNING, logger="carpool.slow"):
        await _two_timed_requests(batcher, fake_model, fake_clock, spawn)

    slow = [r for r in caplog.records if r.name == "carpool.slow"]
    assert len(slow) == 1  # r1 took 1.0 s; r2 took 0.5 s
    message = slow[0].getMessage()
    assert "request 0" in message
    assert "compute 750.00 ms" in message


async def test_memory_probe_feeds_memory_volatility(make_batcher):
    samples = iter([(100, 1000), (300, 1000), (200, 1000)])
    batcher = make_batcher(max_delay_s=0.0, memory_probe=lambda: next(samples))
    await batcher.start()
    assert batcher.snapshot().memory is None

    for i in range(3):
        await batcher.submit(i)

    memory = batcher.snapshot().memory
    assert memory is not None
    assert (memory.num_samples, memory.peak_bytes, memory.trough_bytes) == (3, 300, 100)
    assert memory.volatility == pytest.approx(0.2)


async def test_raising_memory_probe_does_not_kill_the_replica(make_batcher, spawn, caplog):
    def probe() -> tuple[int, int]:
        raise OSError("device went away")

    batcher = make_batcher(max_batch_size=1, max_delay_s=10.0, memory_probe=probe)
    with caplog.at_level(logging.ERROR, logger="carpool"):
        tasks = [spawn(batcher.submit(i)) for i in range(3)]
        await settle()
    assert [t.result() for t in tasks if t.done()] == [0, 10, 20]
    assert "memory_probe" in caplog.text
    await batcher.stop()


async def test_unknown_priority_is_rejected(make_batcher):
    batcher = make_batcher()
    with pytest.raises(InvalidInput, match="unknown priority 'urgent'"):
        await batcher.submit(1, priority="urgent")
    assert batcher.num_pending == 0


async def test_unhashable_priority_is_invalid_input(make_batcher):
    """docs/core.md: an unknown priority is InvalidInput (not a bare TypeError)."""
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    priority: Any = ["interactive"]
    with pytest.raises(InvalidInput, match="priority"):
        await batcher.submit(1, priority=priority)


# -- construction -------------------------------------------------------------------------


async def test_fn_factory_builds_one_model_per_device_on_its_replica_thread(make_batcher, spawn):
    built: list[tuple[str, str]] = []

    def factory(device: str) -> Any:
        built.append((device, threading.current_thread().name))

        async def model(batch: list[int]) -> list[str]:
            return [f"{device}:{x}" for x in batch]

        return model

    batcher = make_batcher(fn_factory=factory, devices=["dev0", "dev1"], max_delay_s=0.0)
    await asyncio.wait_for(batcher.start(), SAFETY_S)

    assert sorted(device for device, _ in built) == ["dev0", "dev1"]
    assert all(name.startswith("carpool-") for _, name in built)
    assert batcher.num_replicas == 2
    assert await batcher.submit(1) in ("dev0:1", "dev1:1")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fn": None}, "fn"),
        ({"fn_factory": lambda device: device}, "fn"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"num_replicas": 3, "devices": ["a", "b"]}, "num_replicas"),
        ({"collate": "arrow"}, "collate"),
    ],
)
def test_contradictory_construction_raises_config_error(kwargs, field):
    async def model(batch: list[int]) -> list[int]:
        return batch

    kwargs = {"fn": model, **kwargs}
    with pytest.raises(ConfigError) as caught:
        Batcher(kwargs.pop("fn"), clock=FakeClock(), **kwargs)
    assert caught.value.field == field


def test_empty_devices_is_refused_naming_devices():
    with pytest.raises(ConfigError, match="devices") as info:
        Batcher(lambda batch: batch, devices=[])
    assert info.value.field == "devices"


def _double(batch: Any) -> Any:
    return batch * 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fn": 42}, "fn"),
        ({"fn": None, "fn_factory": "cpu"}, "fn_factory"),
        ({"policy": {"max_batch_size": 8}}, "policy"),
        ({"policy": 8}, "policy"),
        ({"devices": "cuda:0"}, "devices"),
        ({"devices": [0, 1]}, "devices[]"),
        ({"collate": 42}, "collate"),
        ({"name": 5}, "name"),
        ({"clock": 5}, "clock"),
        ({"on_trace": "print"}, "on_trace"),
        ({"memory_probe": 5}, "memory_probe"),
        ({"policy_check": 5}, "policy_check"),
        ({"slow_request_s": -1.0}, "slow_request_s"),
        ({"slow_request_s": "0.2"}, "slow_request_s"),
        ({"switch_interval_s": True}, "switch_interval_s"),
    ],
)
def test_batcher_refuses_an_argument_of_the_wrong_kind_naming_it(
    kwargs: dict[str, Any], field: str
) -> None:
    options = {"fn": _double, **kwargs}
    fn = options.pop("fn")
    with pytest.raises(ConfigError) as caught:
        Batcher(fn, **options)
    assert caught.value.field == field
    assert "expected" in str(caught.value)


async def test_cost_fn_that_cannot_price_a_payload_is_invalid_input(make_batcher):
    batcher = make_batcher(collate="list", max_batch_cost=10.0, cost_fn=len)
    with pytest.raises(InvalidInput, match="cost_fn"):
        await batcher.submit(5)  # len(5) raises TypeError
    assert batcher.snapshot().classes["normal"].rejections == {"invalid": 1}


async def test_preferred_size_closes_early_only_when_filled_exactly(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(
        collate="list", max_batch_size=8, max_delay_s=1.0, preferred_batch_sizes=(4,)
    )
    first = spawn(batcher.submit_many([1, 2, 3]))
    second = spawn(batcher.submit_many([4, 5, 6]))
    await settle()
    assert fake_model.batches == []  # 3 or 6 items cannot make exactly 4: wait
    await fake_clock.advance(1.0)
    assert fake_model.sizes == [6]
    assert await finish(first, second) == [[10, 20, 30], [40, 50, 60]]


async def test_preferred_size_filled_by_a_prefix_is_sent_when_a_many_request_straddles_a_larger(
    make_batcher, fake_model, fake_clock, spawn
):
    """Preferred (2, 4); requests of 1, 1 and 3 items: no FIFO prefix makes 4, but the
    first two make 2, a preferred size the queue can fill now (Triton sends it). Trimming
    towards 4 used to go past 2 and then give up, so everything waited for the delay."""
    batcher = make_batcher(
        collate="list", max_batch_size=8, max_delay_s=1.0, preferred_batch_sizes=(2, 4)
    )
    tasks = [spawn(batcher.submit(1)), spawn(batcher.submit(2))]
    tasks.append(spawn(batcher.submit_many([3, 4, 5])))
    await settle()
    assert fake_model.sizes == [2]

    await fake_clock.advance(1.0)
    assert fake_model.sizes == [2, 3]
    assert await finish(*tasks) == [10, 20, [30, 40, 50]]


async def test_replica_thread_inherits_the_torch_thread_count(make_batcher, monkeypatch):
    calls: list[tuple[str, int]] = []

    class FakeTorch:
        @staticmethod
        def get_num_threads() -> int:
            return 1

        @staticmethod
        def set_num_threads(n: int) -> None:
            calls.append((threading.current_thread().name, n))

    # OpenMP's thread count is per thread; the replica thread must be told explicitly.
    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    batcher = make_batcher(fn=lambda batch: list(batch), collate="list", max_delay_s=0.0)
    assert await asyncio.wait_for(batcher.submit(3), 5.0) == 3
    assert len(calls) == 1
    thread_name, count = calls[0]
    assert thread_name.startswith("carpool-") and count == 1


# -- GIL switch interval ------------------------------------------------------------------


@pytest.fixture
def default_switch_interval() -> Any:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


async def test_sync_batcher_lowers_the_switch_interval_until_the_last_one_stops(
    fake_clock, default_switch_interval
):
    first = Batcher(lambda b: list(b), collate="list", clock=fake_clock)
    second = Batcher(lambda b: list(b), collate="list", clock=fake_clock)
    await first.start()
    await second.start()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    await first.stop()
    assert sys.getswitchinterval() == pytest.approx(0.0005)  # second still runs
    await second.stop()
    assert sys.getswitchinterval() == pytest.approx(default_switch_interval)


@pytest.mark.parametrize("opt_out", ["async model", "switch_interval_s=None"])
async def test_switch_interval_is_left_alone_without_a_sync_model_or_when_opted_out(
    fake_clock, default_switch_interval, opt_out
):
    async def async_model(batch: Any) -> Any:
        return list(batch)

    if opt_out == "async model":
        batcher = Batcher(async_model, collate="list", clock=fake_clock)
    else:
        batcher = Batcher(
            lambda b: list(b), collate="list", clock=fake_clock, switch_interval_s=None
        )
    async with batcher:
        assert sys.getswitchinterval() == pytest.approx(default_switch_interval)


def test_invalid_switch_interval_is_a_config_error():
    with pytest.raises(ConfigError, match="switch_interval_s"):
        Batcher(lambda b: b, switch_interval_s=0)


# -- enqueue_many and cancel: the task-free path the HTTP server uses -------------------------


async def test_enqueue_many_resolves_its_future_like_submit_many(
    make_batcher, fake_model, fake_clock
):
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    request = batcher.enqueue_many([1, 2])
    await settle()
    assert request.future.result() == [10, 20]
    assert fake_model.batches == [[1, 2]]


async def test_cancel_withdraws_a_queued_request_before_the_model_sees_it(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_delay_s=0.0)
    await occupy(batcher, fake_model, spawn, fake_clock)
    kept, withdrawn = batcher.enqueue_many([1]), batcher.enqueue_many([2])
    batcher.cancel(withdrawn)
    assert batcher.num_pending == 1
    fake_model.release()
    await settle()
    assert fake_model.batches == [[-1], [1]]
    assert kept.future.result() == [10]
    assert withdrawn.future.cancelled()
    assert batcher.snapshot().classes["normal"].rejections == {"cancelled": 1}


async def test_cancel_of_a_running_request_lets_its_batch_finish(
    make_batcher, fake_model, fake_clock, loop_errors
):
    batcher = make_batcher(max_delay_s=0.0)
    await batcher.start()
    fake_model.hold()
    first, second = batcher.enqueue_many([1]), batcher.enqueue_many([2])
    await settle()
    batcher.cancel(first)
    fake_model.release()
    await settle()
    assert first.future.cancelled()
    assert second.future.result() == [20]
    assert loop_errors == []


async def test_enqueue_many_refuses_before_start_and_after_stop(make_batcher):
    batcher = make_batcher()
    with pytest.raises(Closed):
        batcher.enqueue_many([1])
    await batcher.start()
    await batcher.stop()
    with pytest.raises(Closed):
        batcher.enqueue_many([1])


async def test_a_queued_request_carries_what_its_caller_and_class_gave_it(
    fake_clock: FakeClock,
) -> None:
    """The request is built positionally (faster on the hot path): each field must still
    land where its name says, also those of one type (cost and arrival, rank and count)."""
    batcher = Batcher(
        lambda batch: batch,
        BatchPolicy(
            max_batch_size=8,
            classes=(*THREE_CLASSES[:2], ClassPolicy("background", timeout_s=0.25)),
        ),
        clock=fake_clock,
    )
    await batcher.start()
    try:
        payload = np.zeros((3, 2), dtype=np.float32)
        first = batcher.enqueue_many(payload, priority="background", cost=5.5)
        second = batcher.enqueue_many(payload[:1], priority="interactive")
        assert (first.request_id, second.request_id) == (0, 1)
        assert first.payload is payload and (first.num_items, first.is_many) == (3, True)
        assert (first.cost, first.arrival_s, first.deadline_s) == (5.5, 1000.0, 1000.25)
        assert (first.class_name, first.rank) == ("background", 2)
        assert (second.class_name, second.rank, second.cost) == ("interactive", 0, 1.0)
        assert second.deadline_s is None and not first.future.done()
        assert first.signature == ("<f4", (2,))  # what NumpyCollator groups by
        for request in (first, second):
            batcher.cancel(request)
    finally:
        await batcher.stop()
