"""BatchTimes: the compute time of a batch of n items, learned from measured batches."""

from __future__ import annotations

import math

import pytest

from carpool.core.batch_times import SMOOTHING, BatchTimes, bucket_of


@pytest.mark.parametrize(
    ("num_items", "bucket"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (64, 6)]
)
def test_sizes_share_a_bucket_up_to_each_power_of_two(num_items: int, bucket: int) -> None:
    assert bucket_of(num_items) == bucket


def test_nothing_measured_predicts_no_time() -> None:
    assert BatchTimes().predict_s(16) == 0.0


def test_a_bucket_follows_its_batches_by_a_moving_average() -> None:
    times = BatchTimes()
    times.observe(16, 0.010)
    assert times.predict_s(16) == pytest.approx(0.010)
    times.observe(12, 0.020)  # same bucket (9..16)
    assert times.predict_s(10) == pytest.approx(0.010 + SMOOTHING * 0.010)


def test_drift_is_followed_within_a_few_dozen_batches() -> None:
    times = BatchTimes()
    for _ in range(50):
        times.observe(8, 0.010)
    for _ in range(30):
        times.observe(8, 0.030)  # the model slowed down (a noisy neighbour)
    assert times.predict_s(8) == pytest.approx(0.030, rel=0.01)


def test_an_unmeasured_size_reads_the_nearest_larger_bucket() -> None:
    times = BatchTimes()
    times.observe(2, 0.002)
    times.observe(64, 0.030)
    assert times.predict_s(8) == pytest.approx(0.030)


def test_a_size_above_all_measured_scales_the_largest_by_size() -> None:
    times = BatchTimes()
    times.observe(4, 0.004)
    assert times.predict_s(16) == pytest.approx(0.016)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_samples_are_ignored(bad: float) -> None:
    times = BatchTimes()
    times.observe(4, bad)
    times.observe(0, 1.0)
    assert times.predict_s(4) == 0.0
    assert times.as_dict() == {}
