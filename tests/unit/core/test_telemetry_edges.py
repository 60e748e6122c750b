"""Telemetry values as a Prometheus exporter reads them: sums that never go down."""

from __future__ import annotations

import math

from carpool.core.telemetry import REJECTION_REASONS, Histogram


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
