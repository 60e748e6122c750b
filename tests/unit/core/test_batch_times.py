"""BatchTimes: the compute time of a batch of n items, learned from measured batches."""

from __future__ import annotations

import math

import pytest

from carpool.core.batch_times import MAX_AGE_S, SMOOTHING, BatchTimes, bucket_of
from carpool.core.clock import FakeClock


def _warm(times: BatchTimes, *sizes: int) -> BatchTimes:
    """Each bucket's first batch is taken as cold and not learned: run one first."""
    for size in sizes:
        times.observe(size, 99.0)
    return times


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.mark.parametrize(
    ("num_items", "bucket"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (64, 6)]
)
def test_sizes_share_a_bucket_up_to_each_power_of_two(num_items: int, bucket: int) -> None:
    assert bucket_of(num_items) == bucket


def test_nothing_measured_predicts_no_time(clock: FakeClock) -> None:
    assert BatchTimes(clock).predict_s(16) == 0.0


def test_the_first_batch_of_a_bucket_is_not_learned(clock: FakeClock) -> None:
    times = BatchTimes(clock)
    times.observe(16, 0.800)  # cold: kernels chosen, weights packed for this shape
    assert times.predict_s(16) == 0.0
    times.observe(16, 0.010)
    assert times.predict_s(16) == pytest.approx(0.010)


def test_a_bucket_follows_its_batches_by_a_moving_average(clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 16)
    times.observe(16, 0.010)
    assert times.predict_s(16) == pytest.approx(0.010)
    times.observe(12, 0.020)  # same bucket (9..16)
    assert times.predict_s(10) == pytest.approx(0.010 + SMOOTHING * 0.010)


def test_drift_is_followed_within_a_few_dozen_batches(clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 8)
    for _ in range(50):
        times.observe(8, 0.010)
    for _ in range(30):
        times.observe(8, 0.030)  # the model slowed down (a noisy neighbour)
    assert times.predict_s(8) == pytest.approx(0.030, rel=0.01)


def test_an_unmeasured_size_reads_the_nearest_larger_bucket(clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 2, 64)
    times.observe(2, 0.002)
    times.observe(64, 0.030)
    assert times.predict_s(8) == pytest.approx(0.030)


async def test_the_lower_bound_of_an_unmeasured_size_never_reads_a_larger_batch_whole(
    clock: FakeClock,
) -> None:
    """What decides that a request would be late: the larger bucket scaled down to the
    size, or the nearest smaller bucket's time, whichever is more; a measured size reads
    its own bucket."""
    times = _warm(BatchTimes(clock), 64)
    times.observe(64, 0.032)
    assert times.predict_at_least_s(1) == pytest.approx(0.0005)  # 0.032 x 1 / 64
    assert times.predict_s(1) == pytest.approx(0.032)  # admission's cautious estimate
    times = _warm(BatchTimes(clock), 2, 64)
    times.observe(2, 0.006)
    times.observe(64, 0.032)
    assert times.predict_at_least_s(8) == pytest.approx(0.006)  # the smaller bucket's
    assert times.predict_at_least_s(2) == pytest.approx(0.006)  # its own
    assert times.predict_at_least_s(64) == pytest.approx(0.032)
    times.observe(64, 0.32)  # the larger bucket slower: its time scaled down is more
    assert times.predict_at_least_s(8) == pytest.approx(times.as_dict()[64] * 8 / 64)
    assert times.predict_at_least_s(8) > 0.006
    await clock.advance(2.0)  # nothing confirmed lately: no estimate
    assert times.predict_at_least_s(8) == 0.0


def test_a_size_above_all_measured_scales_the_largest_by_size(clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 4)
    times.observe(4, 0.004)
    assert times.predict_s(16) == pytest.approx(0.016)


async def test_an_estimate_no_batch_confirmed_lately_is_not_used(clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 8, 64)
    times.observe(64, 0.030)
    await clock.advance(MAX_AGE_S / 2)
    times.observe(8, 0.900)  # a hiccup longer than any timeout: no batch would run
    await clock.advance(MAX_AGE_S / 2 + 0.001)
    assert times.predict_s(8) == pytest.approx(0.900)
    assert times.predict_s(32) == pytest.approx(3.6)  # the 8s, scaled: the stale 64s are not read
    await clock.advance(MAX_AGE_S / 2)
    assert times.predict_s(8) == 0.0  # so a batch runs, and measures the model again
    assert times.as_dict() == {8: pytest.approx(0.900), 64: pytest.approx(0.030)}


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_samples_are_ignored(bad: float, clock: FakeClock) -> None:
    times = _warm(BatchTimes(clock), 4)
    times.observe(4, bad)
    times.observe(0, 1.0)
    assert times.predict_s(4) == 0.0
    assert times.as_dict() == {}


def test_the_line_learns_the_models_own_time_and_the_estimate_the_span() -> None:
    """A model in steps on the loop: 10 ms of its own inside a 50 ms span."""
    times = BatchTimes(FakeClock())
    for size in [1, 2, 4, 8] * 3:
        times.observe(size, 0.05, model_s=0.01)
    assert times.fit.predict_s(4) == pytest.approx(0.01)
    assert times.predict_s(4) == pytest.approx(0.05)


def test_a_batch_of_less_than_one_cost_unit_is_learned() -> None:
    """Under ``max_batch_cost`` a batch is counted in its cost, which may be a fraction
    (megapixels, say): such batches must still teach the estimate and the line."""
    times = BatchTimes(FakeClock())
    for _ in range(3):
        times.observe(0.25, 0.01)
    assert times.predict_s(0.25) == pytest.approx(0.01)
    assert times.fit.num_batches == 2  # the bucket's first (cold) batch is not learned


def test_the_stretch_follows_the_span_over_the_models_own_time(clock: FakeClock) -> None:
    times = BatchTimes(clock)
    assert times.fit.stretch == 1.0  # a model with its core to itself
    for _ in range(3):  # the first batch of a size is cold and not learned
        times.observe(8, 0.015, model_s=0.01)
    assert 1.0 < times.fit.stretch < 1.5
    for _ in range(60):
        times.observe(8, 0.015, model_s=0.01)
    assert times.fit.stretch == pytest.approx(1.5)
    for _ in range(60):  # a model in one call: its span is its own time
        times.observe(8, 0.01)
    assert times.fit.stretch == pytest.approx(1.0, abs=1e-4)
