"""The load generator's engine: arrival processes (seeded, statistically sane), open and
closed loops on a fake clock, and coordinated omission made visible."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from carpool.core.clock import FakeClock
from carpool.errors import ConfigError
from carpool.tools import loadgen
from carpool.tools.loadgen import (
    TIMEOUT,
    Arrival,
    ArrivalProcess,
    LoadGenerator,
    RateStep,
    RequestRecord,
    RunResult,
    parse_duration,
    parse_schedule,
    read_trace,
)
from carpool.tools.summary import summarize

STEP_S = 0.0005


def _times(process: ArrivalProcess, duration_s: float, seed: int = 0) -> np.ndarray:
    return process.send_times(duration_s, np.random.default_rng(seed))


def _cv2(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.var() / gaps.mean() ** 2)


# -- arrival processes --------------------------------------------------------------------


def test_constant_arrivals_are_evenly_spaced_at_the_rate() -> None:
    times = _times(ArrivalProcess.steady(200.0, Arrival.CONSTANT), 1.0)
    assert len(times) == 200
    assert np.allclose(np.diff(times), 1 / 200)
    assert times[0] == 0.0


def test_poisson_arrivals_have_the_mean_rate_and_unit_cv() -> None:
    times = _times(ArrivalProcess.steady(1000.0, Arrival.POISSON), 20.0)
    assert len(times) / 20.0 == pytest.approx(1000.0, rel=0.03)
    assert _cv2(times) == pytest.approx(1.0, rel=0.1)
    assert np.all(np.diff(times) >= 0) and times[-1] < 20.0


def test_gamma_burstiness_raises_the_cv_but_keeps_the_rate() -> None:
    poisson = _times(ArrivalProcess.steady(1000.0, Arrival.POISSON), 20.0)
    bursty = _times(ArrivalProcess.steady(1000.0, Arrival.GAMMA, burstiness=4.0), 20.0)
    assert len(bursty) / 20.0 == pytest.approx(1000.0, rel=0.05)
    assert _cv2(bursty) == pytest.approx(4.0, rel=0.15)
    assert _cv2(bursty) > 2 * _cv2(poisson)


def test_gamma_below_one_is_more_regular_than_poisson() -> None:
    smooth = _times(ArrivalProcess.steady(1000.0, Arrival.GAMMA, burstiness=0.25), 10.0)
    assert _cv2(smooth) == pytest.approx(0.25, rel=0.15)


def test_same_seed_same_times_other_seed_other_times() -> None:
    process = ArrivalProcess.steady(500.0, Arrival.POISSON)
    assert np.array_equal(_times(process, 2.0, seed=7), _times(process, 2.0, seed=7))
    assert not np.array_equal(_times(process, 2.0, seed=7), _times(process, 2.0, seed=8))


def test_schedule_follows_each_steps_rate() -> None:
    process = ArrivalProcess(Arrival.POISSON, parse_schedule("0:50,10s:200,20s:50"))
    times = _times(process, 30.0)
    counts = [np.sum((times >= a) & (times < a + 10)) for a in (0, 10, 20)]
    assert counts[0] == pytest.approx(500, rel=0.15)
    assert counts[1] == pytest.approx(2000, rel=0.08)
    assert counts[2] == pytest.approx(500, rel=0.15)


def test_a_zero_rate_step_sends_nothing_then_resumes() -> None:
    process = ArrivalProcess(Arrival.CONSTANT, (RateStep(0, 100), RateStep(1, 0), RateStep(2, 100)))
    times = _times(process, 3.0)
    assert not np.any((times >= 1.0) & (times < 2.0))
    assert np.sum(times >= 2.0) == pytest.approx(100, abs=1)


@pytest.mark.parametrize(
    ("steps", "burstiness"),
    [
        ((), 1.0),
        ((RateStep(1.0, 10),), 1.0),
        ((RateStep(0, 10), RateStep(0, 20)), 1.0),
        ((RateStep(0, -1),), 1.0),
        ((RateStep(0, 0),), 1.0),
        ((RateStep(0, 10),), 0.0),
    ],
)
def test_invalid_processes_are_refused(steps: tuple[RateStep, ...], burstiness: float) -> None:
    with pytest.raises(ConfigError):
        ArrivalProcess(Arrival.GAMMA, steps, burstiness)


@pytest.mark.parametrize(
    ("text", "seconds"), [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1.5", 1.5), ("1h", 3600)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ten", "5 days", "-1s"])
def test_parse_duration_refuses_garbage(text: str) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)


def test_parse_schedule_and_its_errors() -> None:
    assert parse_schedule("0:50,1m:5") == (RateStep(0.0, 50.0), RateStep(60.0, 5.0))
    with pytest.raises(ConfigError, match="start:rate"):
        parse_schedule("0-50")


def test_read_trace_sorts_and_skips_comments(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("# replay\n0.5\n\n0.0\n0.25  # noon\n")
    assert read_trace(trace).tolist() == [0.0, 0.25, 0.5]


def test_read_trace_names_the_bad_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    trace.write_text("0.1\nsoon\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_trace(trace)
    with pytest.raises(ConfigError, match="readable"):
        read_trace(tmp_path / "missing.txt")


# -- running on a fake clock ---------------------------------------------------------------


class SerialTarget:
    """One 'connection': requests queue on a lock, so a stall delays every later send.
    Service time comes from ``service_s(index)``, on the fake clock."""

    description = "serial fake"

    def __init__(self, clock: FakeClock, service_s: Callable[[int], float | None]) -> None:
        self._clock = clock
        self._service_s = service_s
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def call(self, record: RequestRecord) -> None:
        async with self._lock:
            record.sent_s = self._clock.now()
            service = self._service_s(record.index)
            if service is None:  # never answers
                await asyncio.get_running_loop().create_future()
            elif service < 0:
                raise RuntimeError("model on fire")
            else:
                done = asyncio.get_running_loop().create_future()
                self._clock.call_at(self._clock.now() + service, lambda: done.set_result(None))
                await done
            record.status = 200
            record.num_items = 2


async def _drive(
    clock: FakeClock, run: asyncio.Task[RunResult], limit_s: float = 60.0
) -> RunResult:
    """Advance the fake clock in small steps until ``run`` finishes."""
    start = clock.now()
    while not run.done():
        assert clock.now() - start < limit_s, "the run did not finish on the fake clock"
        await clock.advance(STEP_S)
    return run.result()


async def test_a_stall_is_charged_from_the_schedule_and_reported_as_behind() -> None:
    clock = FakeClock()
    target = SerialTarget(clock, lambda i: 0.1 if i == 0 else 0.001)
    generator = LoadGenerator(target, clock=clock)
    times = ArrivalProcess.steady(100.0, Arrival.CONSTANT).send_times(0.5, np.random.default_rng())
    result = await _drive(clock, asyncio.create_task(generator.run_open(times)))
    summary = summarize(result)

    assert summary.num_ok == 50
    # Request 1 was scheduled at 10 ms but could only leave at ~100 ms (after the stall):
    # its latency counts from 10 ms, not from when it left.
    first_after = result.records[1]
    assert first_after.lag_s == pytest.approx(0.09, abs=0.002)
    assert first_after.latency_s == pytest.approx(0.091, abs=0.002)
    assert first_after.latency_s > first_after.done_s - first_after.sent_s
    assert summary.num_behind_schedule >= 9
    assert summary.max_lag_s == pytest.approx(0.09, abs=0.002)
    assert summary.latency is not None and summary.latency.max_s >= 0.1


async def test_open_loop_that_keeps_up_is_never_behind() -> None:
    clock = FakeClock()
    generator = LoadGenerator(SerialTarget(clock, lambda i: 0.001), clock=clock)
    times = ArrivalProcess.steady(100.0, Arrival.CONSTANT).send_times(0.3, np.random.default_rng())
    summary = summarize(await _drive(clock, asyncio.create_task(generator.run_open(times))))
    assert summary.num_ok == 30
    assert summary.num_behind_schedule == 0
    assert summary.items_per_s == pytest.approx(2 * summary.rate_rps)
    assert summary.offered_rate_rps == pytest.approx(30 / 0.29)


async def test_progress_keeps_only_the_latest_latencies(monkeypatch: pytest.MonkeyPatch) -> None:
    # The live display reads the latest ones; a long run must not keep one per request.
    monkeypatch.setattr(loadgen, "RECENT_LATENCIES", 5)
    clock = FakeClock()
    generator = LoadGenerator(SerialTarget(clock, lambda i: 0.001), clock=clock)
    times = ArrivalProcess.steady(100.0, Arrival.CONSTANT).send_times(0.3, np.random.default_rng())
    result = await _drive(clock, asyncio.create_task(generator.run_open(times)))
    assert len(result.records) == 30
    latest = sorted(result.records, key=lambda r: r.done_s)[-5:]
    assert list(generator.progress.recent_latency_s) == pytest.approx([r.latency_s for r in latest])


async def test_closed_loop_sends_back_to_back_for_the_duration() -> None:
    clock = FakeClock()
    generator = LoadGenerator(SerialTarget(clock, lambda i: 0.01), clock=clock)
    run = asyncio.create_task(generator.run_closed(4, 0.2))
    summary = summarize(await _drive(clock, run))
    # One shared lock: 10 ms each, ~20 done in 0.2 s plus the last ones queued at the end.
    assert 20 <= summary.num_ok <= 24
    assert summary.concurrency == 4 and summary.mode == "closed"
    assert summary.num_errors == 0


async def test_failures_are_counted_by_name_and_unanswered_requests_time_out() -> None:
    clock = FakeClock()

    def service(index: int) -> float | None:
        return {1: -1.0, 3: None}.get(index, 0.001)

    generator = LoadGenerator(SerialTarget(clock, service), clock=clock, drain_timeout_s=1.0)
    times = [0.0, 0.01, 0.02, 0.03, 0.04]
    summary = summarize(await _drive(clock, asyncio.create_task(generator.run_open(times))))
    assert summary.errors == {"RuntimeError": 1, TIMEOUT: 2}  # #3 hangs, #4 waits behind it
    assert summary.num_ok == 2
    assert generator.progress.num_errors == 3


def test_record_properties() -> None:
    record = RequestRecord(0, scheduled_s=1.0, sent_s=1.5, done_s=2.0, first_token_s=1.75)
    assert (record.lag_s, record.latency_s, record.ttft_s) == (0.5, 1.0, 0.75)
    assert record.is_ok
    assert math.isnan(RequestRecord(1, 0.0).done_s)


async def test_closed_loop_refuses_zero_concurrency() -> None:
    generator = LoadGenerator(SerialTarget(FakeClock(), lambda i: 0.0))
    with pytest.raises(ConfigError, match="concurrency"):
        await generator.run_closed(0, 1.0)
