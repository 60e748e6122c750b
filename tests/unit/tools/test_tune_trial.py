"""The stability loop: fake windows, no wall clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carpool.errors import ConfigError
from carpool.tools.tune_trial import (
    MeasureSettings,
    TargetRefused,
    TrialConfig,
    WindowSample,
    measure_trial,
    spread,
    summarize,
)

from .conftest import SurfaceRunner

CONFIG = TrialConfig((("max_batch_size", 4),))


async def test_stops_after_k_windows_when_throughput_is_steady() -> None:
    runner = SurfaceRunner(windows=[100.0, 101.0, 100.0, 100.0, 100.0, 100.0])
    settings = MeasureSettings(warmup_s=0.5, window_s=1.0, stable_spread=0.05, max_windows=10)
    m = await measure_trial(runner, CONFIG, settings)
    # the warm-up window consumed the first scripted value
    assert runner.calls == ["start", "window 0.5", "window 1.0", "window 1.0", "window 1.0", "end"]
    assert m.num_windows == 3 and m.is_stable
    assert m.spread == pytest.approx(1 / (301 / 3))


async def test_keeps_measuring_until_the_last_k_windows_agree() -> None:
    runner = SurfaceRunner(windows=[0.0, 50.0, 100.0, 200.0, 100.0, 100.0, 100.0, 100.0])
    settings = MeasureSettings(warmup_s=1.0, window_s=1.0, stable_spread=0.05, max_windows=10)
    m = await measure_trial(runner, CONFIG, settings)
    assert m.window_rps == (50.0, 100.0, 200.0, 100.0, 100.0, 100.0)
    assert m.is_stable and m.spread == 0.0


async def test_stops_at_max_windows_when_never_stable() -> None:
    runner = SurfaceRunner(windows=[10.0, 100.0] * 10)
    settings = MeasureSettings(warmup_s=0.0, window_s=1.0, stable_spread=0.05, max_windows=4)
    m = await measure_trial(runner, CONFIG, settings)
    assert m.num_windows == 4 and not m.is_stable
    assert m.throughput_rps == pytest.approx(55.0)
    assert runner.calls[-1] == "end"


async def test_a_shorter_trial_scales_max_windows_down_but_not_below_one() -> None:
    settings = MeasureSettings(warmup_s=0.0, max_windows=9, num_stable_windows=3)
    assert settings.windows_for(1.0) == (3, 9)
    assert settings.windows_for(1 / 3) == (3, 3)
    assert settings.windows_for(1 / 9) == (1, 1)
    runner = SurfaceRunner(windows=[10.0, 100.0] * 10)
    m = await measure_trial(runner, CONFIG, settings, scale=1 / 9)
    assert m.num_windows == 1


async def test_a_refused_config_is_a_failed_measurement() -> None:
    runner = SurfaceRunner()
    m = await measure_trial(runner, TrialConfig((("max_batch_size", 0),)), MeasureSettings())
    assert m.error is not None and "max_batch_size" in m.error
    assert m.num_requests == 0 and math.isnan(m.p99_s)


async def test_a_server_that_refuses_access_ends_the_search_not_just_the_trial() -> None:
    """A 403 (policy updates not allowed) or 401 would fail every trial alike: it stops
    the search at once with what the server needs (was: each trial failed with it, and
    the run ended saying no trial met the constraints)."""

    class Refusing(SurfaceRunner):
        async def start_trial(self, config: TrialConfig) -> None:
            raise TargetRefused("target", "http://s/v2/models/m", "a server that allows it")

    with pytest.raises(TargetRefused, match="allows it"):
        await measure_trial(Refusing(), CONFIG, MeasureSettings())


def test_summarize_pools_windows() -> None:
    windows = [
        WindowSample(1.0, 10, 1, np.full(10, 0.010), mean_batch_size=2.0, memory_bytes=5),
        WindowSample(1.0, 30, 0, np.full(30, 0.020), mean_batch_size=6.0, memory_bytes=7),
    ]
    m = summarize(windows, k=2, stable_spread=0.05)
    assert m.throughput_rps == 20.0 and m.throughput_items_s == 20.0
    assert m.p50_s == pytest.approx(0.020) and m.p99_s == pytest.approx(0.020)
    assert m.mean_batch_size == pytest.approx(40 / 10)  # 5 + 5 batches carried 40 items
    assert m.memory_bytes == 7 and m.num_errors == 1
    assert not m.is_stable and m.spread == pytest.approx(1.0)


def test_spread_is_relative_width() -> None:
    assert spread([90.0, 110.0, 100.0]) == pytest.approx(0.2)
    assert spread([0.0, 0.0]) == 0.0
    assert spread([0.0, 1.0, -1.0]) == math.inf


@pytest.mark.parametrize(
    "kw",
    [
        {"window_s": 0},
        {"warmup_s": -1},
        {"stable_spread": -0.1},
        {"max_windows": 0},
        {"num_stable_windows": 0},
    ],
)
def test_settings_are_validated(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        MeasureSettings(**kw)  # type: ignore[arg-type]
