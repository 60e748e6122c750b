"""The sweep: batch sizes, timing with an injected clock, the knee, the memory budget."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from carpool.errors import ModelError
from carpool.tools.doctor_sweep import (
    batch_sizes,
    find_knee,
    fit_memory,
    max_batch_under_budget,
    measure_sweep,
)

MIB = 1024 * 1024


class CostClock:
    """A clock that only moves when the fake model runs: 1 ms + 0.1 ms per item."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def model(self, batch: Any) -> dict[str, Any]:
        self.now_s += 0.001 + 0.0001 * len(batch)
        return {"output": np.asarray(batch)}


class FakeMemory:
    """Reports 1 MiB + 0.5 MiB per item of the batch the sweep is on."""

    def __init__(self, sizes: list[int]) -> None:
        self._sizes = iter(sizes)
        self.current = 0

    def start(self) -> None:
        self.current = next(self._sizes)

    def stop(self) -> int:
        return MIB + self.current * MIB // 2


def test_batch_sizes_are_powers_of_two_plus_the_maximum() -> None:
    assert batch_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert batch_sizes(1) == [1]


def test_sweep_times_each_size_with_the_injected_clock_and_probe() -> None:
    clock = CostClock()
    sizes = [1, 2, 4]
    timings = measure_sweep(
        clock.model,
        lambda n: np.zeros((n, 3)),
        sizes,
        repeats=5,
        warmup=2,
        clock=clock,
        memory=FakeMemory(sizes),
    )
    assert [t.batch_size for t in timings] == sizes
    assert [t.num_calls for t in timings] == [5, 5, 5]
    assert timings[2].median_s == pytest.approx(0.0014)
    assert timings[2].items_per_s == pytest.approx(4 / 0.0014)
    assert timings[1].memory_bytes == 2 * MIB


def test_sweep_records_a_failing_size_and_goes_on() -> None:
    def fails_alone(batch: Any) -> dict[str, Any]:
        if len(batch) == 1:
            raise ValueError("needs two items")
        return {"output": batch}

    timings = measure_sweep(fails_alone, lambda n: np.zeros((n, 3)), [1, 2], repeats=1, warmup=0)
    assert timings[0].error == "ValueError: needs two items"
    assert math.isnan(timings[0].median_s)
    assert timings[1].error is None


def test_sweep_raises_when_every_size_fails() -> None:
    def broken(batch: Any) -> dict[str, Any]:
        raise RuntimeError("boom")

    with pytest.raises(ModelError, match="every batch size"):
        measure_sweep(broken, lambda n: np.zeros((n, 3)), [1, 2], repeats=1, warmup=0)


# -- the knee -------------------------------------------------------------------------------


def _saturating(sizes: list[int], overhead_s: float, per_item_s: float) -> list[tuple[int, float]]:
    return [(b, b / (overhead_s + per_item_s * b)) for b in sizes]


def test_knee_is_where_doubling_stops_paying() -> None:
    # 1 ms fixed + 0.1 ms per item: gains 1.83, 1.71, 1.56, 1.38, then 1.24, 1.14, 1.07
    verdict = find_knee(_saturating(batch_sizes(128), 0.001, 0.0001), min_gain=1.3)
    assert verdict.knee_batch_size == 16
    assert [round(g, 2) for _, _, g in verdict.gains[:5]] == [1.83, 1.71, 1.56, 1.38, 1.24]


def test_knee_ignores_an_early_dip_when_throughput_later_scales_again() -> None:
    points = [(1, 100.0), (2, 110.0), (4, 300.0), (8, 600.0), (16, 650.0), (32, 660.0)]
    assert find_knee(points).knee_batch_size == 8


def test_no_knee_while_throughput_still_scales() -> None:
    verdict = find_knee([(1, 100.0), (2, 200.0), (4, 400.0)])
    assert verdict.knee_batch_size is None
    assert "larger --max-batch" in verdict.reason


def test_a_step_that_is_not_a_doubling_needs_a_proportional_gain() -> None:
    # 64 -> 100 is 1.56x the batch: the bar is 1.3 ** log2(1.5625) = 1.18x, 1.15x misses it
    points = [(32, 100.0), (64, 200.0), (100, 230.0)]
    assert find_knee(points).knee_batch_size == 64


# -- the memory budget ----------------------------------------------------------------------


def test_fit_memory_uses_the_largest_batches() -> None:
    points = [(1, 50 * MIB), (32, 10 * MIB + 32 * MIB), (64, 10 * MIB + 64 * MIB)]
    points.append((128, 10 * MIB + 128 * MIB))
    slope, intercept = fit_memory(points)
    assert slope == pytest.approx(MIB)
    assert intercept == pytest.approx(10 * MIB)


def test_budget_extrapolates_past_the_measured_sizes() -> None:
    points = [(b, 10 * MIB + b * MIB) for b in (16, 32, 64)]
    verdict = max_batch_under_budget(points, 1024 * MIB)
    assert verdict.method == "extrapolated"
    assert verdict.max_batch_size == 1014


def test_budget_interpolates_between_measured_sizes_that_bracket_it() -> None:
    points = [(b, b * MIB) for b in (16, 32, 64)]
    verdict = max_batch_under_budget(points, 48 * MIB)
    assert (verdict.method, verdict.max_batch_size) == ("interpolated", 48)


def test_budget_reports_none_when_one_item_is_already_too_much() -> None:
    verdict = max_batch_under_budget([(1, 8 * MIB), (2, 16 * MIB)], 4 * MIB)
    assert verdict.max_batch_size is None
    assert "batch 1 already" in verdict.reason


def test_budget_is_unbounded_when_memory_does_not_grow() -> None:
    verdict = max_batch_under_budget([(1, MIB), (64, MIB), (128, MIB)], 64 * MIB)
    assert (verdict.method, verdict.max_batch_size) == ("unbounded", None)


def test_rss_probe_reports_growth_while_an_array_is_alive() -> None:
    # In a fresh interpreter: deep into the test suite this process's RSS readings stopped
    # moving for a new 64 MiB array (a kernel/allocator effect outside the probe).
    code = (
        "import numpy as np\n"
        "from carpool.tools.doctor_sweep import RssProbe\n"
        "probe = RssProbe()\n"
        "probe.start()\n"
        "block = np.ones(64 * 2**20 // 8)\n"
        "print(probe.stop())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.strip()) >= 48 * MIB


def test_knee_of_a_single_batch_size_does_not_claim_throughput_still_grows() -> None:
    verdict = find_knee([(1, 100.0)])
    assert verdict.knee_batch_size is None
    assert "still grows" not in verdict.reason
    assert "one batch size" in verdict.reason


def test_knee_of_a_model_whose_throughput_never_improves_is_batch_one() -> None:
    verdict = find_knee([(1, 100.0), (2, 100.0), (4, 99.0), (8, 100.0)])
    assert verdict.knee_batch_size == 1
