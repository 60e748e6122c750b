"""The queue bound in time (``max_queue_time_s``, :mod:`carpool.core.queue_time`): the wait
predicted from the queue and the batch times measured, and the batcher refusing on it.

Time is a FakeClock; the model is the conftest's async fake, held while a test decides
what waits. Batches of one take 0.3 s of fake time once learned (:func:`_learn`).
"""

from __future__ import annotations

import pickle

import pytest

from carpool import BatchPolicy, ClassPolicy, ConfigError, QueueFull, QueueTooLong
from carpool.core.clock import settle
from carpool.core.policy import ClassLimits
from carpool.core.queue_time import check_queue_time, predict_wait_s
from carpool.core.queues import Queues
from carpool.core.request import Request

from .conftest import finish, occupy

BATCH_S = 0.3  # a batch of one, on the fake model below


def _line(size: float) -> float:
    return 0.001 + 0.0001 * size  # 1 ms + 0.1 ms a unit


def _request(request_id: int, class_name: str, rank: int, num_items: int = 1) -> Request:
    return Request(
        request_id,
        None,
        num_items,
        num_items > 1,
        float(num_items),
        class_name,
        rank,
        0.0,
        None,
        None,
    )


def _queues(policy: BatchPolicy, counts: dict[str, int]) -> Queues:
    queues = Queues(policy)
    ids = iter(range(10_000))
    for name, count in counts.items():
        rank = policy.limits[name].rank
        for _ in range(count):
            queues.admit(_request(next(ids), name, rank))
    return queues


def test_nothing_queued_ahead_waits_nothing_and_asks_for_nothing() -> None:
    policy = BatchPolicy(max_batch_size=32)

    def never() -> float:
        raise AssertionError("not asked with nothing queued ahead")

    limits = policy.limits["normal"]
    assert predict_wait_s(Queues(policy), limits, 1, "items", never, 1, never, _line) == (0, 0)


def test_the_wait_is_the_running_batch_then_the_full_batches_ahead() -> None:
    policy = BatchPolicy(max_batch_size=32)
    queues = _queues(policy, {"normal": 100})
    limits = policy.limits["normal"]
    wait_s, own_s = predict_wait_s(
        queues, limits, 1, "items", lambda: 32.0, 1, lambda: 0.005, _line
    )
    # 101 items in batches of 32: three full ones ahead, its own holds the last 5.
    assert wait_s == pytest.approx(0.005 + 3 * _line(32))
    assert own_s == pytest.approx(_line(5))
    # Two replicas drain the batches ahead twice as fast.
    wait_2, _ = predict_wait_s(queues, limits, 1, "items", lambda: 32.0, 2, lambda: 0.0, _line)
    assert wait_2 == pytest.approx(3 * _line(32) / 2)


def test_only_the_class_and_those_above_it_are_ahead() -> None:
    policy = BatchPolicy(max_batch_size=8)
    queues = _queues(policy, {"interactive": 8, "background": 800})
    cap, busy = (lambda: 8.0), (lambda: 0.0)
    interactive = policy.limits["interactive"]
    normal = policy.limits["normal"]
    # The interactive request waits for the 8 interactive ones only.
    assert predict_wait_s(queues, interactive, 1, "items", cap, 1, busy, _line)[0] == (
        pytest.approx(_line(8))
    )
    # A normal one too: the background queue is below it.
    assert predict_wait_s(queues, normal, 1, "items", cap, 1, busy, _line)[0] == (
        pytest.approx(_line(8))
    )


def test_a_class_on_a_share_of_the_replicas_drains_on_that_share() -> None:
    policy = BatchPolicy(max_batch_size=4)
    queues = _queues(policy, {"background": 16})
    background = policy.limits["background"]  # share 0.5: 2 of 4 replicas
    wait_s, _ = predict_wait_s(queues, background, 1, "items", lambda: 4.0, 4, lambda: 0.0, _line)
    assert wait_s == pytest.approx(4 * _line(4) / 2)


def test_a_fixed_bound_refuses_a_longer_wait_naming_both() -> None:
    limits = BatchPolicy(max_queue_time_s=0.05).limits["normal"]
    check_queue_time(limits, 0.05, 1.0)  # at the bound: admitted (its own batch not counted)
    with pytest.raises(QueueTooLong) as caught:
        check_queue_time(limits, 0.0625, 0.0)
    error = caught.value
    assert isinstance(error, QueueFull)  # caught as any queue bound is: 429, UNAVAILABLE
    assert (error.queue, error.wait_s, error.limit, error.slo_s) == ("normal", 0.0625, 0.05, None)
    assert str(error) == (
        "queue 'normal' holds about 62.5 ms of work ahead of this request, more than "
        "max_queue_time_s=50.0 ms; retry later"
    )
    again = pickle.loads(pickle.dumps(error))  # crosses a worker process as it is
    assert (type(again), str(again), again.wait_s) == (QueueTooLong, str(error), 0.0625)


def test_auto_refuses_an_answer_that_would_come_past_the_slo_less_its_headroom() -> None:
    limits = BatchPolicy(slo_s=0.05, max_queue_time_s="auto").limits["normal"]
    # The controller plans with 80% of slo_s (SLO_HEADROOM): 40 ms here.
    check_queue_time(limits, 0.02, 0.02)  # its batch ends at 40 ms: in time
    with pytest.raises(QueueTooLong) as caught:
        check_queue_time(limits, 0.021, 0.02)
    assert caught.value.limit == pytest.approx(0.02)
    assert "more than the 20.0 ms that slo_s=50.0 ms leaves for it (max_queue_time_s: auto)" in (
        str(caught.value)
    )


def test_a_class_bound_overrides_the_model_bound_and_auto_needs_an_slo() -> None:
    policy = BatchPolicy(
        max_queue_time_s=0.1,
        classes=(ClassPolicy("fast", max_queue_time_s=0.01), ClassPolicy("slow")),
        default_class="slow",
    )
    assert policy.limits["fast"].max_queue_time_s == 0.01
    assert policy.limits["slow"].max_queue_time_s == 0.1
    auto = BatchPolicy(slo_s=0.2, max_queue_time_s="auto").limits["normal"]
    assert (auto.is_auto_queue_time, auto.max_queue_time_s) == (True, None)
    assert ClassLimits("x", 0, 1, 0.0, None, None, 1.0, None, None).max_queue_time_s is None
    with pytest.raises(ConfigError, match=r"classes\['only'\]\.max_queue_time_s"):
        BatchPolicy(max_queue_time_s="auto", classes=(ClassPolicy("only"),), default_class="only")
    for bad in (-0.1, float("nan"), "soon", True):
        with pytest.raises(ConfigError, match="max_queue_time_s"):
            BatchPolicy(max_queue_time_s=bad)
        with pytest.raises(ConfigError, match="max_queue_time_s"):
            ClassPolicy("c", max_queue_time_s=bad)


async def _learn(batcher, fake_model, fake_clock, spawn) -> None:
    """Two batches of one taking BATCH_S each (the first of a size is not learned)."""
    for _ in range(2):
        blocker = await occupy(batcher, fake_model, spawn, fake_clock)
        await fake_clock.advance(BATCH_S)
        fake_model.release()
        await finish(blocker)


async def test_the_batcher_refuses_what_would_wait_too_long_and_admits_it_later(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=1, max_delay_s=0.0, max_queue_time_s=0.5)
    await _learn(batcher, fake_model, fake_clock, spawn)
    blocker = await occupy(batcher, fake_model, spawn, fake_clock)
    first = spawn(batcher.submit(1))  # nothing ahead: admitted
    refused = spawn(batcher.submit(2))  # the running batch, then the first: 0.6 s
    await settle()
    error = refused.exception()
    assert isinstance(error, QueueTooLong)
    assert error.wait_s == pytest.approx(2 * BATCH_S)
    assert batcher.snapshot().classes["normal"].rejections == {"queue_full": 1}
    await fake_clock.advance(0.2)  # the running batch has 0.1 s left: 0.4 s now
    admitted = spawn(batcher.submit(3))
    await settle()
    assert not admitted.done()
    fake_model.release()
    assert await finish(blocker, first, admitted) == [-10, 10, 30]


async def test_auto_counts_the_requests_own_batch_against_its_slo(
    make_batcher, fake_model, fake_clock, spawn
):
    # slo_s 0.8 s: the controller's 80% of it is 0.64 s.
    batcher = make_batcher(max_batch_size=1, max_delay_s=0.0, slo_s=0.8, max_queue_time_s="auto")
    await _learn(batcher, fake_model, fake_clock, spawn)
    blocker = await occupy(batcher, fake_model, spawn, fake_clock)
    first = spawn(batcher.submit(1))
    refused = spawn(batcher.submit(2))  # answered after 0.3 + 0.3 + 0.3 s: past 0.64
    await settle()
    assert isinstance(refused.exception(), QueueTooLong)
    assert refused.exception().slo_s == 0.8
    await fake_clock.advance(BATCH_S)  # the running batch is due: 0.3 + its own 0.3
    admitted = spawn(batcher.submit(3))
    await settle()
    fake_model.release()
    assert await finish(blocker, first, admitted) == [-10, 10, 30]


async def test_a_model_slower_than_the_slo_still_serves_a_request_with_nothing_ahead(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=1, max_delay_s=0.0, slo_s=0.1, max_queue_time_s="auto")
    await _learn(batcher, fake_model, fake_clock, spawn)  # 0.3 s a batch, the SLO 0.1 s
    blocker = await occupy(batcher, fake_model, spawn, fake_clock)
    alone = spawn(batcher.submit(5))  # late whatever happens, but not shut out
    await settle()
    fake_model.release()
    assert await finish(blocker, alone) == [-10, 50]


async def test_without_a_bound_in_time_nothing_is_refused(
    make_batcher, fake_model, fake_clock, spawn
):
    batcher = make_batcher(max_batch_size=1, max_delay_s=0.0)
    await _learn(batcher, fake_model, fake_clock, spawn)
    blocker = await occupy(batcher, fake_model, spawn, fake_clock)
    tasks = [spawn(batcher.submit(i)) for i in range(20)]
    await settle()
    fake_model.release()
    assert await finish(blocker, *tasks) == [-10, *(10 * i for i in range(20))]
