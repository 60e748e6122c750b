"""The searches on a fake trial runner with a known response surface (no wall clock)."""

from __future__ import annotations

import math

import pytest

from carpool.errors import ConfigError
from carpool.tools.tune import Constraints, Param, SearchSpace, Tuner, policy_values, rank_key
from carpool.tools.tune_trial import Measurement, MeasureSettings, TrialConfig, measure_trial

from .conftest import SurfaceRunner, measured, surface

SLO_S = 0.020
SETTINGS = MeasureSettings(warmup_s=0.5, window_s=1.0, max_windows=5)


def _space() -> SearchSpace:
    return SearchSpace(
        (
            Param.parse("max_delay_s=0,0.002,0.01,0.05"),
            Param.parse("max_batch_size=1,4,16,64"),
        )
    )


def _tuner(space: SearchSpace, runner: SurfaceRunner | None = None, **kw: object) -> Tuner:
    runner = runner or SurfaceRunner()

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        return await measure_trial(runner, config, SETTINGS, scale)

    return Tuner(space, Constraints(SLO_S), measure, **kw)  # type: ignore[arg-type]


def _true_best(space: SearchSpace) -> dict[str, float]:
    feasible = [space.config(i).as_dict() for i in space.grid()]
    feasible = [c for c in feasible if surface(c)[1] <= SLO_S]
    return max(feasible, key=lambda c: surface(c)[0])


async def test_grid_measures_every_point_and_finds_the_best_under_the_slo() -> None:
    space = _space()
    outcome = await _tuner(space).run("grid")
    assert len(outcome.results) == space.size == 16
    assert outcome.best is not None
    assert (
        outcome.best.config.as_dict()
        == _true_best(space)
        == {
            "max_delay_s": 0.01,
            "max_batch_size": 16,
        }
    )
    assert all(r.is_feasible == (surface(r.config.as_dict())[1] <= SLO_S) for r in outcome.results)


async def test_taguchi_runs_the_array_then_confirms_the_predicted_best() -> None:
    space = _space()
    outcome = await _tuner(space).run("taguchi")
    assert outcome.design is not None and outcome.design.array.name == "L16(4^5)"
    stages = [r.stage for r in outcome.results]
    # The best the effects predict is one of the array's rows here: no run is left to
    # confirm it (a predicted row the array did not run gets a "confirm" trial).
    assert stages == ["oa"] * 16
    assert outcome.effects is not None and len(outcome.effects) == 2
    assert outcome.best is not None and outcome.best.config.as_dict() == _true_best(space)


async def test_taguchi_on_a_larger_space_runs_fewer_trials_than_the_grid() -> None:
    space = SearchSpace((
        Param.parse("max_delay_s=0,0.002,0.01"),
        Param.parse("max_batch_size=4,16,64"),
        Param.parse("num_replicas=1,2,4"),
    ))  # fmt: skip
    outcome = await _tuner(space).run("taguchi")
    assert len(outcome.results) <= 10 < space.size
    assert outcome.best is not None and outcome.best.is_feasible
    effects = {e.factor: e for e in outcome.effects or []}
    assert effects["num_replicas"].best_level == 2  # more replicas: more throughput, same p99


async def test_hill_climbs_from_the_array_to_the_best_point() -> None:
    space = SearchSpace((
        Param.parse("max_delay_s=0,0.002,0.006,0.01,0.02"),
        Param.parse("max_batch_size=1,4,8,16,32"),
        Param.parse("num_replicas=1,2,3,4,5"),
    ))  # fmt: skip
    outcome = await _tuner(space).run("hill")
    assert {r.stage for r in outcome.results} >= {"oa", "hill"}
    assert outcome.best is not None
    assert outcome.best.config.as_dict() == _true_best(space)
    assert len(outcome.results) < space.size
    indexes = [r.index for r in outcome.results]
    assert len(indexes) == len(set(indexes))  # no point measured twice


async def test_successive_halving_shortens_early_rounds_and_keeps_the_best() -> None:
    space = _space()
    scales: list[float] = []
    runner = SurfaceRunner()

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        scales.append(scale)
        return await measure_trial(runner, config, SETTINGS, scale)

    outcome = await Tuner(space, Constraints(SLO_S), measure, eta=2).run("halving")
    rounds = [r.stage for r in outcome.results]
    assert [rounds.count(f"halving r{i}") for i in range(5)] == [16, 8, 4, 2, 1]
    assert scales[0] == pytest.approx(1 / 16) and scales[-1] == 1.0
    assert outcome.results[-1].config.as_dict() == _true_best(space)
    assert outcome.best is not None and outcome.best.config.as_dict() == _true_best(space)


async def test_no_feasible_trial_means_no_best() -> None:
    space = _space()
    runner = SurfaceRunner()

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        return await measure_trial(runner, config, SETTINGS, scale)

    outcome = await Tuner(space, Constraints(1e-6), measure).run("taguchi")
    assert outcome.best is None
    assert all(not r.is_feasible for r in outcome.results)


async def test_a_config_the_runner_refuses_is_an_infeasible_trial() -> None:
    space = SearchSpace((Param("max_batch_size", (0, 4)),))
    outcome = await _tuner(space).run("grid")
    refused, fine = outcome.results
    assert refused.measurement.error is not None and "ConfigError" in refused.violations[0]
    assert refused.objective == 0.0 and fine.is_feasible


async def test_unknown_strategy_or_objective_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="search"):
        await _tuner(_space()).run("annealing")
    with pytest.raises(ConfigError, match="objective"):
        _tuner(_space(), objective="latency")


def test_param_parse_types_values_and_refuses_nonsense() -> None:
    assert Param.parse("max_batch_size=2,4,8").values == (2, 4, 8)
    assert Param.parse("max_delay_s=0,0.002").values == (0.0, 0.002)
    assert isinstance(Param.parse("num_replicas=1,2").values[0], int)
    for bad in ["max_batch_size", "warp_speed=1,2", "max_batch_size=a,b", "max_delay_s=1,1"]:
        with pytest.raises(ConfigError):
            Param.parse(bad)


def test_param_parse_searches_auto_against_numbers_where_the_policy_takes_it() -> None:
    assert Param.parse("max_delay_s=0,0.002,auto").values == (0.0, 0.002, "auto")
    assert Param.parse("max_batch_size=16,auto").values == (16, "auto")
    assert Param.parse("max_queue_time_s=0.05,auto").values == (0.05, "auto")
    with pytest.raises(ConfigError, match='or "auto"'):
        Param.parse("max_delay_s=0,soon")
    with pytest.raises(ConfigError):
        Param.parse("timeout_s=auto")  # no adaptive timeout


def test_buffer_pool_param_takes_on_off_levels() -> None:
    assert Param.parse("buffer_pool=off,on").values == (0, 1)
    assert Param.parse("buffer_pool=0,1").values == (0, 1)
    assert Param.parse("buffer_pool=True,False").values == (1, 0)
    with pytest.raises(ConfigError, match="on/off"):
        Param.parse("buffer_pool=maybe,on")


def test_preempt_param_takes_on_off_levels_and_reaches_the_policy_as_a_bool() -> None:
    assert Param.parse("preempt=off,on").values == (0, 1)
    assert policy_values({"preempt": 1, "max_delay_s": 0.002}) == {
        "preempt": True,
        "max_delay_s": 0.002,
    }


def test_space_neighbours_stay_on_the_grid() -> None:
    space = _space()
    assert sorted(space.neighbours((0, 0))) == [(0, 1), (1, 0)]
    assert len(list(space.neighbours((1, 2)))) == 4
    with pytest.raises(ConfigError):
        SearchSpace((Param.parse("max_delay_s=0,1"), Param.parse("max_delay_s=0,2")))


def test_constraints_name_every_violation() -> None:
    constraints = Constraints(0.01, memory_budget_bytes=2**20)
    assert constraints.violations(measured(100, 0.005)) == ()
    slow = constraints.violations(measured(100, 0.02, memory_bytes=2**21, num_errors=50))
    assert [v.split()[0] for v in slow] == ["50", "p99", "memory"]
    assert constraints.violations(measured(0, math.nan))  # nothing answered: not feasible


def test_rank_key_puts_feasible_then_faster_then_lower_latency_first() -> None:
    from carpool.tools.tune import TrialResult

    def result(objective: float, p99_s: float, ok: bool) -> TrialResult:
        config = TrialConfig((("max_batch_size", 1),))
        m = measured(objective, p99_s)
        return TrialResult(0, "grid", (0,), config, m, () if ok else ("x",), objective)

    ordered = sorted(
        [result(50, 0.001, False), result(10, 0.002, True), result(10, 0.001, True)],
        key=rank_key,
    )
    assert [(r.objective, r.measurement.p99_s, r.is_feasible) for r in ordered] == [
        (10, 0.001, True),
        (10, 0.002, True),
        (50, 0.001, False),
    ]


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
    assert best is not None and best.config.as_dict() == {"max_batch_size": 1}


def test_exactly_one_percent_failed_is_not_under_one_percent() -> None:
    constraints = Constraints(0.05)
    assert constraints.violations(_m(100.0, num_errors=1, num_requests=99))
    assert not constraints.violations(_m(100.0, num_errors=1, num_requests=100))
    assert not constraints.violations(_m(0.0, num_errors=0, num_requests=0, p99_s=0.01))
