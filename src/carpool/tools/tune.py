"""``carpool tune``: search the batching settings for the most throughput under a latency SLO.

The space is a grid of levels per parameter (``--param max_delay_s=0,0.002,0.01``). A
search picks which points to measure; each point is one trial (see
:mod:`carpool.tools.tune_trial`). A trial is *feasible* when its p99 latency is within the
SLO and its memory (when measured) within the budget; the best trial is the feasible one
with the most throughput::

    grid      every point
    taguchi   the rows of the smallest orthogonal array, then a confirmation run at the
              best level of each factor (main effects on throughput, infeasible runs = 0)
    hill      taguchi, then climb: from the best point, measure the +-1-level neighbours
              and move while one is better
    halving   successive halving: every point with short trials, keep the best 1/eta,
              measure those eta times longer, until one is left
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from carpool.core.policy import BatchPolicy
from carpool.errors import ConfigError
from carpool.tools.orthogonal import Design, FactorEffect, design_for, main_effects
from carpool.tools.tune_trial import Measurement, TrialConfig

Number = int | float | str  # a level: a number, or "auto" (AUTO_PARAMS)
# Parameters that may also be searched at "auto" (carpool.core.adaptive, and
# carpool.core.queue_time for the queue bound in time), against numbers.
AUTO_PARAMS = ("max_batch_size", "max_delay_s", "max_queue_time_s")
# Parameters a trial can set, with their types: BatchPolicy fields, the replica count and
# the batch buffer pool (0 off, 1 on; rebuilt like the replica count).
TUNABLE: dict[str, type] = {
    "max_batch_size": int,
    "max_delay_s": float,
    "max_queue_size": int,
    "max_queue_time_s": float,
    "max_batch_tokens": int,
    "max_batch_cost": float,
    "timeout_s": float,
    "oom_recovery_s": float,
    "num_replicas": int,
    "buffer_pool": bool,
    "preempt": bool,
}
# Parameters that rebuild the batcher rather than change its policy.
REBUILDS = ("num_replicas", "buffer_pool")
_NOT_POLICY = ("buffer_pool", "preempt")  # on/off levels: any 0/1 runs
_BOOLS = {"0": False, "false": False, "off": False, "1": True, "true": True, "on": True}
STRATEGIES = ("grid", "taguchi", "hill", "halving")
OBJECTIVES = ("throughput", "items")


@dataclass(frozen=True, slots=True)
class Param:
    """One searched parameter and its levels, in the order given."""

    name: str
    values: tuple[Number, ...]

    def __post_init__(self) -> None:
        if self.name not in TUNABLE:
            raise ConfigError("param", self.name, f"one of {sorted(TUNABLE)}")
        if not self.values or len(set(self.values)) != len(self.values):
            raise ConfigError(f"param {self.name}", self.values, "distinct values, at least one")

    @classmethod
    def parse(cls, text: str) -> Param:
        """``name=v1,v2,...``; raises :class:`ConfigError` naming what is wrong."""
        name, sep, rest = text.partition("=")
        name = name.strip()
        if not sep or not rest.strip():
            raise ConfigError("--param", text, "name=v1,v2,... (e.g. max_delay_s=0,0.002)")
        kind = TUNABLE.get(name)
        if kind is None:
            raise ConfigError("--param", name, f"one of {sorted(TUNABLE)}")
        try:
            values = tuple(_level(name, kind, v) for v in rest.split(","))
        except (ValueError, KeyError, OverflowError):
            also = ' or "auto"' if name in AUTO_PARAMS else ""
            raise ConfigError(
                f"--param {name}",
                rest,
                "comma-separated on/off (or 1/0, true/false)"
                if kind is bool
                else f"comma-separated {kind.__name__}s{also}",
            ) from None
        for value in values:
            _check_level(name, value)
        return cls(name, values)


def policy_values(changes: dict[str, Number]) -> dict[str, Number | bool]:
    """A trial's levels as the policy takes them: an on/off parameter's 0/1 as a bool."""
    return {k: bool(v) if TUNABLE.get(k) is bool else v for k, v in changes.items()}


def _level(name: str, kind: type, text: str) -> Number:
    if text.strip() == "auto" and name in AUTO_PARAMS:
        return "auto"
    if kind is bool:
        return int(_BOOLS[text.strip().lower()])  # a level 0 or 1: the report prints numbers
    number = float(text)
    if kind is int and not number.is_integer():  # 2.7 ran as 2 (inf: OverflowError)
        raise ValueError(text)
    return int(number) if kind is int else number


def _check_level(name: str, value: Number) -> None:
    """Refuse a level no trial could run (before the first trial: exit 2, not a search
    whose every trial fails). Policy fields are checked as the policy checks them.

    Raises:
        ConfigError: naming the parameter and what it takes.
    """
    if name == "num_replicas":
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"--param {name}", value, "integers >= 1")
        return
    if name in _NOT_POLICY:
        return
    try:
        BatchPolicy().replace(**{name: value})
    except ConfigError as error:
        raise ConfigError(f"--param {name}", value, error.expected) from None


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The grid of every combination of the parameters' levels."""

    params: tuple[Param, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if not names or len(set(names)) != len(names):
            raise ConfigError("params", names, "at least one parameter, each named once")

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def num_levels(self) -> list[int]:
        return [len(p.values) for p in self.params]

    @property
    def size(self) -> int:
        return math.prod(self.num_levels)

    def config(self, index: tuple[int, ...]) -> TrialConfig:
        return TrialConfig(
            tuple((p.name, p.values[i]) for p, i in zip(self.params, index, strict=True))
        )

    def grid(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(n) for n in self.num_levels))

    def neighbours(self, index: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        """Points one level away along one axis."""
        for axis, count in enumerate(self.num_levels):
            for step in (-1, 1):
                level = index[axis] + step
                if 0 <= level < count:
                    yield (*index[:axis], level, *index[axis + 1 :])


@dataclass(frozen=True, slots=True)
class Constraints:
    """What a feasible trial keeps within; ``None`` means unconstrained."""

    slo_p99_s: float
    memory_budget_bytes: int | None = None

    def violations(self, m: Measurement) -> tuple[str, ...]:
        out = []
        if m.error is not None:
            out.append(f"error: {m.error}")
        # Feasible means *under* 1% of the requests failed: exactly 1% is not.
        if m.num_errors > 0 and m.num_errors >= 0.01 * (m.num_requests + m.num_errors):
            out.append(f"{m.num_errors} failed requests")
        if not m.p99_s <= self.slo_p99_s:  # NaN (nothing answered) violates too
            out.append(f"p99 {m.p99_s * 1e3:.1f} ms > SLO {self.slo_p99_s * 1e3:.1f} ms")
        budget = self.memory_budget_bytes
        if budget is not None and m.memory_bytes is not None and m.memory_bytes > budget:
            out.append(f"memory {m.memory_bytes / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB")
        return tuple(out)


@dataclass(frozen=True, slots=True)
class TrialResult:
    """One measured point of the space, judged against the constraints."""

    trial_id: int
    stage: str
    index: tuple[int, ...]
    config: TrialConfig
    measurement: Measurement
    violations: tuple[str, ...]
    objective: float  # the objective's value (0 when nothing was measured)
    scale: float = 1.0  # the trial's length, relative to a full one (halving's early rounds)

    @property
    def is_feasible(self) -> bool:
        return not self.violations


def rank_key(result: TrialResult) -> tuple[int, float, float]:
    """Sorts best first: feasible before infeasible, then more objective, then lower p99."""
    p99 = result.measurement.p99_s
    return (0 if result.is_feasible else 1, -result.objective, p99 if p99 == p99 else math.inf)


@dataclass(slots=True)
class TuneOutcome:
    """Every trial in the order run, the best one, and the main effects when an OA ran."""

    strategy: str
    space: SearchSpace
    constraints: Constraints
    objective: str
    results: list[TrialResult] = field(default_factory=list)
    design: Design | None = None
    effects: list[FactorEffect] | None = None

    @property
    def best(self) -> TrialResult | None:
        """The best feasible point by :func:`rank_key`, judged on each point's latest
        trial (a longer one supersedes a shorter one it may refute) and among the longest
        trials that are feasible: successive halving recommends its survivor, not a short
        early-round trial that happened to measure higher."""
        latest: dict[tuple[int, ...], TrialResult] = {}
        for result in self.results:
            latest[result.index] = result
        feasible = [r for r in latest.values() if r.is_feasible]
        if not feasible:
            return None
        longest = max(r.scale for r in feasible)
        return min((r for r in feasible if r.scale == longest), key=rank_key)


Measure = Callable[[TrialConfig, float], Awaitable[Measurement]]  # (config, duration scale)


class Tuner:
    """Runs one search strategy, measuring each point once per stage through ``measure``.

    Args:
        space: the parameters and their levels.
        constraints: the SLO and memory budget.
        measure: measures one config; its second argument scales the trial's length
            (successive halving gives its early rounds less than 1).
        objective: ``throughput`` (requests/s) or ``items`` (items/s).
        eta: successive halving keeps the best ``1/eta`` each round.
        max_hill_steps: most moves of the hill climb.
        on_result: called with each result as it lands (progress output).
    """

    def __init__(
        self,
        space: SearchSpace,
        constraints: Constraints,
        measure: Measure,
        *,
        objective: str = "throughput",
        eta: int = 3,
        max_hill_steps: int = 20,
        on_result: Callable[[TrialResult], None] | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ConfigError("objective", objective, f"one of {list(OBJECTIVES)}")
        if eta < 2:
            raise ConfigError("eta", eta, "an integer >= 2")
        self.space = space
        self.constraints = constraints
        self._measure = measure
        self.objective = objective
        self.eta = eta
        self.max_hill_steps = max_hill_steps
        self._on_result = on_result
        self._seen: dict[tuple[int, ...], TrialResult] = {}

    async def run(self, strategy: str) -> TuneOutcome:
        """Search with ``strategy`` (one of :data:`STRATEGIES`)."""
        if strategy not in STRATEGIES:
            raise ConfigError("search", strategy, f"one of {list(STRATEGIES)}")
        outcome = TuneOutcome(strategy, self.space, self.constraints, self.objective)
        self._seen = {}
        if strategy == "grid":
            for index in self.space.grid():
                await self._trial(outcome, index, "grid")
        elif strategy == "halving":
            await self._halving(outcome)
        else:
            await self._taguchi(outcome)
            if strategy == "hill":
                await self._hill(outcome)
        return outcome

    async def _trial(
        self, outcome: TuneOutcome, index: tuple[int, ...], stage: str, scale: float = 1.0
    ) -> TrialResult:
        config = self.space.config(index)
        m = await self._measure(config, scale)
        value = m.throughput_rps if self.objective == "throughput" else m.throughput_items_s
        result = TrialResult(
            trial_id=len(outcome.results),
            stage=stage,
            index=index,
            config=config,
            measurement=m,
            violations=self.constraints.violations(m),
            objective=value if value == value else 0.0,
            scale=scale,
        )
        outcome.results.append(result)
        self._seen[index] = result
        if self._on_result is not None:
            self._on_result(result)
        return result

    async def _taguchi(self, outcome: TuneOutcome) -> None:
        design = design_for(self.space.num_levels)
        outcome.design = design
        rows = [tuple(int(v) for v in row) for row in design.levels]
        for index in rows:
            if index not in self._seen:
                await self._trial(outcome, index, "oa")
        # Infeasible runs count as no throughput: the effects then point at levels that
        # are both fast and within the SLO.
        responses = [self._seen[i].objective if self._seen[i].is_feasible else 0.0 for i in rows]
        outcome.effects = main_effects(
            self.space.names, design.levels, np.array(responses), with_sn=True
        )
        predicted = tuple(e.best_level for e in outcome.effects)
        if predicted not in self._seen:
            await self._trial(outcome, predicted, "confirm")

    async def _hill(self, outcome: TuneOutcome) -> None:
        current = min(outcome.results, key=rank_key)
        for _ in range(self.max_hill_steps):
            step_best = current
            for index in self.space.neighbours(current.index):
                result = self._seen.get(index) or await self._trial(outcome, index, "hill")
                if rank_key(result) < rank_key(step_best):
                    step_best = result
            if step_best is current:
                return
            current = step_best

    async def _halving(self, outcome: TuneOutcome) -> None:
        alive = list(self.space.grid())
        sizes = [len(alive)]
        while sizes[-1] > 1:
            sizes.append(max(1, sizes[-1] // self.eta))
        last = len(sizes) - 1
        for round_no, size in enumerate(sizes):
            # The last round (one config left) runs full length; each earlier one 1/eta less.
            scale = float(self.eta) ** (round_no - last)
            stage = f"halving r{round_no}"
            results = [await self._trial(outcome, i, stage, scale) for i in alive[:size]]
            results.sort(key=rank_key)
            if round_no < last:
                alive = [r.index for r in results[: sizes[round_no + 1]]]
