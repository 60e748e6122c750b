"""bench_adaptive_embeddings: the SLO from the unloaded p50, on a histogram bound."""

from __future__ import annotations

from bench_adaptive_embeddings import slo_from_unloaded

BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25)


def test_slo_is_the_factor_times_p50_rounded_up_to_a_bound() -> None:
    assert slo_from_unloaded(0.013, 5.0, BOUNDS) == 0.1  # 65 ms -> 100 ms
    assert slo_from_unloaded(0.004, 5.0, BOUNDS) == 0.025  # 20 ms -> 25 ms


def test_slo_on_a_bound_stays_there() -> None:
    assert slo_from_unloaded(0.01, 5.0, BOUNDS) == 0.05


def test_slo_past_every_bound_is_the_largest() -> None:
    assert slo_from_unloaded(1.0, 5.0, BOUNDS) == 0.25
