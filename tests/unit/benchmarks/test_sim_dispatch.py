"""sim_dispatch.py's accounting, on a tiny simulation (4 replicas, 1 s simulated): every
request answered once, throughput within capacity, balance a fraction. Never timing."""

from __future__ import annotations

import gc
import math

import pytest

from carpool.server.heap import YOUNG_GC_THRESHOLD
from sim_dispatch import (
    SimConfig,
    batch_time_s,
    check_targets,
    collector_as_served,
    poisson_arrivals,
    replica_speeds,
    simulate,
)


def tiny(num_replicas: int, load: float, seed: int) -> SimConfig:
    """5 + 20 slowest full-batch times of 40 ms: one simulated second."""
    return SimConfig(
        num_replicas, load, seed, warmup_batches=5.0, window_batches=20.0, min_window_batches=0
    )


def test_the_collector_runs_as_carpool_serve_sets_it_then_as_it_was() -> None:
    thresholds = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with collector_as_served():
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *thresholds[1:])
        assert gc.get_freeze_count() > frozen  # the heap at the start is out of its reach
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("load", [0.5, 0.95])
async def test_tiny_simulation_answers_every_request_once(load: float) -> None:
    config = tiny(4, load, seed=0)

    result = await simulate(config)

    assert result.num_requests > 100
    assert result.num_answered_ok == result.num_requests
    assert result.num_answered_twice == 0
    window_s = 20.0 * batch_time_s(config.max_batch_size, 1.0, config)
    # A replica may finish one batch started before the window inside it: that much over.
    slack_rps = config.num_replicas * config.max_batch_size / window_s
    assert 0.0 < result.throughput_rps <= result.capacity_rps + slack_rps
    assert 0.0 <= result.balance <= 1.0
    assert all(0.0 <= f <= 1.0 for f in result.busy_fractions)
    assert 1.0 <= result.mean_batch_size <= config.max_batch_size
    assert result.p99_queue_wait_s >= 0.0
    assert result.num_batches > 0
    assert math.isfinite(result.cpu_per_batch_us)


async def test_same_seed_gives_the_same_simulation() -> None:
    config = tiny(3, 0.7, seed=5)

    first, second = await simulate(config), await simulate(config)

    assert (first.num_requests, first.num_batches) == (second.num_requests, second.num_batches)
    assert first.busy_fractions == second.busy_fractions


def test_replica_speeds_are_seeded_and_at_most_spread_apart() -> None:
    speeds = replica_speeds(1000, 3.0, seed=1)

    assert speeds == replica_speeds(1000, 3.0, seed=1)
    assert all(1.0 <= s <= 3.0 for s in speeds)
    assert max(speeds) / min(speeds) > 2.5


def test_poisson_arrivals_are_ordered_and_inside_the_interval() -> None:
    times = poisson_arrivals(1000.0, 10.0, 12.0, seed=0)

    assert all(10.0 <= t < 12.0 for t in times)
    assert list(times) == sorted(times)
    assert 1800 < len(times) < 2200  # 2000 expected; 4.5 sigma either side


def test_targets_are_judged_at_ninety_percent_from_ten_replicas() -> None:
    def row(n: int, keep_up: float, balance: float, cpu_us: float) -> dict[str, float]:
        return {
            "num_replicas": n,
            "load": 0.9,
            "tput_over_offered": keep_up,
            "balance": balance,
            "cpu_per_batch_us": cpu_us,
            "carpool_cpu_per_batch_us": cpu_us,
        }

    rows = [row(1, 0.5, 0.1, 1.0), row(10, 0.99, 0.95, 100.0), row(1000, 0.96, 0.92, 250.0)]

    verdicts = [ok for _, ok, _ in check_targets(rows)]

    assert verdicts == [True, False, False, False]
