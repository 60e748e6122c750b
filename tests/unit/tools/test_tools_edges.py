"""Adversarial edge cases of the tuning tools: bench's offered rate and schedules, the
tuner's open-loop latency, successive halving's answer and its error budget, and the
doctor's invariance check and knee on NaN outputs and single sizes."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from carpool.core.clock import FakeClock
from carpool.tools.bench import BenchConfig, Point, PointResult, run_bench
from carpool.tools.benchreport import text_table
from carpool.tools.doctor_checks import check_invariance, deviation
from carpool.tools.doctor_sweep import find_knee
from carpool.tools.loadgen import Arrival, ArrivalProcess, Mode, RequestRecord, RunResult
from carpool.tools.summary import summarize
from carpool.tools.targets import TargetSpec
from carpool.tools.tune import Constraints, Param, SearchSpace, Tuner
from carpool.tools.tune_runners import LoadDriver, LoadSpec
from carpool.tools.tune_trial import Measurement, TrialConfig

MODULE = """
import numpy as np

def double(batch):
    return np.asarray(batch) * 2
"""


def _bench_config(point: Point, *, duration_s: float, warmup_s: float) -> BenchConfig:
    return BenchConfig(
        spec=TargetSpec(target="edgemodels:double", input_shape=(1, 4)),
        points=(point,),
        duration_s=duration_s,
        warmup_s=warmup_s,
        seed=3,
        drain_timeout_s=5.0,
        json_path=None,
        csv_path=None,
        plots_dir=None,
        show_progress=False,
    )


@pytest.fixture
def edgemodels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "edgemodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


# -- bench ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("edgemodels")
async def test_offered_rate_is_the_scheduled_requests_over_the_duration() -> None:
    # 100 req/s for 50 ms is 5 sends at 0, 10, ..., 40 ms: 100 req/s offered, not 5 / 40 ms.
    point = Point("rate=100", arrivals=ArrivalProcess.steady(100.0, Arrival.CONSTANT))
    [result] = await run_bench(_bench_config(point, duration_s=0.05, warmup_s=0.0))
    assert result.summary.num_requests == 5
    assert result.summary.offered_rate_rps == pytest.approx(100.0)


@pytest.mark.usefixtures("edgemodels")
async def test_the_warmup_does_not_change_the_measured_schedule() -> None:
    point = Point("rate=400", arrivals=ArrivalProcess.steady(400.0, Arrival.POISSON))
    counts = set()
    for warmup_s in (0.0, 0.01, 0.03):
        [result] = await run_bench(_bench_config(point, duration_s=0.05, warmup_s=warmup_s))
        counts.add(result.summary.num_requests)
    expected = len(ArrivalProcess.steady(400.0, Arrival.POISSON).send_times(
        0.05, np.random.default_rng(3)
    ))  # fmt: skip
    assert counts == {expected}


def test_text_table_shows_the_offered_rate_next_to_the_achieved_one() -> None:
    records = [
        RequestRecord(i, i * 0.01, sent_s=i * 0.01, done_s=i * 0.01 + 0.5) for i in range(10)
    ]
    result = RunResult(Mode.OPEN, records, 0.0, 0.1, offered_rate_rps=100.0)
    summary = summarize(result)
    table = text_table([PointResult("rate=100", summary, None, [])])
    # 10 answers over 0.59 s: the server received less than was offered, and says so.
    assert summary.rate_rps == pytest.approx(10 / 0.59)
    assert "offered 100.0 req/s, achieved 16.9 req/s" in table


def test_text_table_shows_ttft_for_single_token_streams() -> None:
    records = [RequestRecord(i, 0.0, sent_s=0.0, done_s=0.1) for i in range(3)]
    for record in records:  # one token each: a first token, no gaps between tokens
        record.first_token_s, record.itl_s, record.num_tokens = 0.05, [], 1
    result = RunResult(Mode.CLOSED, records, 0.0, 0.1, concurrency=1)
    table = text_table([PointResult("c=1", summarize(result), None, [])])
    assert "ttft p50 50.00 ms" in table


# -- tune -------------------------------------------------------------------------------------


class _StalledClock(FakeClock):
    """A fake clock read from ``now[0]``, which a model moves while it blocks the loop."""

    def __init__(self, now: list[float]) -> None:
        super().__init__(now[0])
        self._cell = now

    def now(self) -> float:
        return self._cell[0]


async def test_tuner_open_loop_counts_latency_from_the_schedule() -> None:
    # A model that blocks the event loop for 1 s on its first call: every arrival due
    # meanwhile leaves late, and its latency must count from when it was due.
    now = [0.0]
    calls = [0]
    done = asyncio.Event()

    async def submit() -> int:
        calls[0] += 1
        if calls[0] == 1:
            now[0] += 1.0  # synchronous: nothing else runs meanwhile
        if calls[0] == 200:
            done.set()
        return 1

    driver = LoadDriver(submit, LoadSpec(rate_rps=1000.0), clock=_StalledClock(now))
    driver.start()
    await done.wait()
    await driver.stop()
    latencies, _, errors = driver.take()
    assert errors == 0 and len(latencies) >= 200
    # Requests 2..200 were due at ~1 ms steps during the stall and answered at 1.0 s.
    assert sum(1 for lat in latencies if lat > 0.5) >= 150


def _m(
    rps: float, p99_s: float = 0.01, num_errors: int = 0, num_requests: int = 100
) -> Measurement:
    return Measurement(rps, rps, p99_s / 2, p99_s, num_requests, num_errors, 1, 0.0, True, 1.0)


async def test_halving_recommends_the_survivor_not_an_early_short_trial() -> None:
    space = SearchSpace((Param("max_batch_size", (1, 2, 4, 8)),))
    # scale 1/4: 8 and 4 lead; scale 1/2: 4 beats 8; scale 1: 4 is the one left.
    script = {
        (8, 0.25): 1000.0, (4, 0.25): 900.0, (2, 0.25): 100.0, (1, 0.25): 50.0,
        (8, 0.5): 500.0, (4, 0.5): 800.0,
        (4, 1.0): 700.0,
    }  # fmt: skip

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        return _m(script[(int(config.as_dict()["max_batch_size"]), scale)])

    outcome = await Tuner(space, Constraints(0.05), measure, eta=2).run("halving")
    assert outcome.results[-1].config.as_dict() == {"max_batch_size": 4}
    assert outcome.best is not None
    assert outcome.best.config.as_dict() == {"max_batch_size": 4}
    assert outcome.best.objective == 700.0  # the full-length measurement, not 900


async def test_halving_does_not_recommend_a_config_its_longer_trial_refuted() -> None:
    space = SearchSpace((Param("max_batch_size", (1, 2)),))
    # Short trial: 2 looks feasible and fast; its full-length trial breaks the SLO.
    script = {(2, 0.5): (900.0, 0.01), (1, 0.5): (100.0, 0.01), (2, 1.0): (800.0, 0.2)}

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        rps, p99 = script[(int(config.as_dict()["max_batch_size"]), scale)]
        return _m(rps, p99)

    outcome = await Tuner(space, Constraints(0.05), measure, eta=2).run("halving")
    best = outcome.best
    assert best is None or best.config.as_dict() != {"max_batch_size": 2}


def test_exactly_one_percent_failed_is_not_under_one_percent() -> None:
    constraints = Constraints(0.05)
    assert constraints.violations(_m(100.0, num_errors=1, num_requests=99))
    assert not constraints.violations(_m(100.0, num_errors=1, num_requests=100))
    assert not constraints.violations(_m(0.0, num_errors=0, num_requests=0, p99_s=0.01))


# -- doctor -----------------------------------------------------------------------------------


def _nan_where_negative(batch: np.ndarray) -> dict[str, np.ndarray]:
    """Row-wise: log of the first feature, NaN for negative inputs, whatever the batch."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"output": np.log(batch[:, :1].astype(np.float64))}


def test_nan_outputs_that_batching_does_not_change_pass() -> None:
    rng = np.random.default_rng(0)
    probes = [np.array([-1.0, 2.0]), np.array([3.0, 1.0])]
    verdict = check_invariance(
        _nan_where_negative,
        probes,
        {"random": lambda n: rng.standard_normal((n, 2))},
        [8],
    )
    assert verdict.is_passed, verdict.reasons


def test_nan_that_only_batching_produces_is_flagged_at_that_size_only() -> None:
    def leaks_at_eight(batch: np.ndarray) -> dict[str, np.ndarray]:
        out = batch[:, :1].astype(np.float64).copy()
        if len(batch) >= 8:
            out[:] = np.nan
        return {"output": out}

    rng = np.random.default_rng(0)
    verdict = check_invariance(
        leaks_at_eight,
        [np.array([1.0, 2.0])],
        {"random": lambda n: rng.standard_normal((n, 2))},
        [2, 8],
    )
    assert not verdict.is_passed
    [flagged] = [d for d in verdict.deviations if d.is_flagged]
    assert flagged.batch_size == 8 and flagged.max_rel == math.inf


def test_deviation_matches_nan_and_inf_in_the_same_places() -> None:
    ref = np.array([np.nan, np.inf, -np.inf, 1.0])
    assert deviation(ref.copy(), ref) == (0.0, 0.0)
    moved = np.array([np.nan, np.inf, -np.inf, 1.5])
    assert deviation(moved, ref) == pytest.approx((0.5, 0.5 / 1.5))
    assert deviation(np.array([np.nan, np.inf, np.inf, 1.0]), ref) == (math.inf, math.inf)
    assert deviation(np.array([1.0, np.inf, -np.inf, 1.0]), ref) == (math.inf, math.inf)


def test_knee_of_a_single_batch_size_does_not_claim_throughput_still_grows() -> None:
    verdict = find_knee([(1, 100.0)])
    assert verdict.knee_batch_size is None
    assert "still grows" not in verdict.reason
    assert "one batch size" in verdict.reason


def test_knee_of_a_model_whose_throughput_never_improves_is_batch_one() -> None:
    verdict = find_knee([(1, 100.0), (2, 100.0), (4, 99.0), (8, 100.0)])
    assert verdict.knee_batch_size == 1
