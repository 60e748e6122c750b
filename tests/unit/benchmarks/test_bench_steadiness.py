"""bench_steadiness: the windows' spread, and a window's work really counted."""

from __future__ import annotations

import os

import pytest

from bench_steadiness import _rates, summarize


def test_summary_gives_the_spread_of_the_windows() -> None:
    row = summarize([float(r) for r in range(1, 11)])  # 1..10
    assert row["windows"] == 10
    assert row["median"] == 5.5 and row["min"] == 1.0 and row["max"] == 10.0
    assert row["p10"] == pytest.approx(1.9) and row["p90"] == pytest.approx(9.1)
    assert row["p90_over_p10"] == pytest.approx(9.1 / 1.9)


@pytest.mark.parametrize("kind", ["python", "matmul"])
def test_each_window_counts_units_of_work_per_second(kind: str) -> None:
    allowed = os.sched_getaffinity(0)
    try:
        rates = _rates(min(allowed), kind, seconds=0.3, window_s=0.05)
    finally:
        os.sched_setaffinity(0, allowed)
    # About six windows; a stalled first unit (BLAS warming up on a busy machine) makes
    # one window longer and the count smaller, never larger than the time allows.
    assert 1 <= len(rates) <= 7
    assert all(rate > 10 for rate in rates)  # a unit is far under 0.1 s on any machine
