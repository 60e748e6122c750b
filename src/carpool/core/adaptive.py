"""The delay and the batch size chosen from the traffic (``max_delay_s: auto``,
``max_batch_size: auto``), within each class's latency budget.

Two measurements drive it: each class's rate of arrivals *while one of its requests
is already waiting* (:class:`CompanyRate`, forgetting with a time constant of
:data:`RATE_TAU_S`) and the model's batch-time line ``t(b) = overhead + per_item * b``
(:class:`~carpool.core.batch_times.BatchTimeFit`, fitted from its own batches). The rate
that counts is the one a waiting request sees, not the overall one: a client that sends
its next request only when the last was answered (concurrency 1) arrives often, but
never while another of its requests waits, so waiting for it would gain nothing; in
open-loop traffic both rates agree. From them, each time a replica is free:

- **Target size.** The smallest batch ``b`` that keeps the replica at most
  :data:`TARGET_UTILIZATION` busy at the class's rate ``r``: ``r * t(b) / b <= rho``.
  At low load that is one request (send at once: waiting buys nothing); as the rate rises it
  grows, and past the model's capacity it is the size cap. With ``rho`` 1 it is the
  size a replica that sends whatever waits whenever it is free settles at (each batch's
  time brings the next batch): the controller waits only when the queue holds less than
  that, where a lower ``rho`` made it wait for larger batches than the load brings, and
  left the replica idle for company a zero window did without. A new target replaces the
  one in force only when it differs by more than :data:`HYSTERESIS` (no flapping
  between neighbours under noise).
- **When to send.** Now, if the queue already holds the target; else when the rate
  says the target will be there, but never later than the oldest request's budget:
  ``slo_s`` less the predicted compute of the target batch (and at most
  :data:`~carpool.core.policy.MAX_AUTO_DELAY_S`), and never later than
  :data:`GAP_FACTOR` mean gaps after the class's last arrival (closed-loop clients that
  are all waiting send nothing more: the batch goes).
- **Closed loops.** Clients that send again as soon as they are answered arrive at the
  rate the server answers at, so the target above settles at whatever size the loop
  runs. When most of each landed batch comes straight back
  (:mod:`carpool.core.returns`), the part of the last batch still on its way is waited
  for (until its return window closes, within the same budget), whatever the target.
- **Size cap** (``max_batch_size: auto``). The knee of ``t(b)``: past
  ``overhead / (KNEE_SHARE * per_item)`` the fixed overhead is under a tenth of the
  batch's time, and a bigger batch only adds latency; but never below the target size
  (under overload the size that keeps up, else the cap), or the queue would only grow.
- **Overload under a queue bound in time** (``max_queue_time_s``,
  :mod:`carpool.core.queue_time`). While more than :data:`REFUSING_SHARE` of a class's
  arrivals are refused at admission, no batch size keeps up, and the size that answers
  the admitted ones in time is the one two of which fit the budget: a request admitted
  as a batch starts waits for it, then rides the next. The line is stretched by the
  batches' span over the model's own time (:attr:`BatchTimeFit.stretch`: the event loop
  reads and answers requests between a model's steps), since that is how long they
  really take.
- **Classes keep their promise.** A batch led by a lower class is capped so that a
  higher class's request arriving just after it starts still fits in its ``slo_s``:
  that batch's time plus one item's (but never below :data:`LOWER_MIN_SHARE` of the size
  cap: a model too slow for the promise, or a line fitted on tiny noisy batches, would
  otherwise run the lower class an item at a time for nothing, and tiny batches would
  never show the line that lets them grow). No batch is larger than one whose predicted time
  alone fits 80% of its class's ``slo_s``. Lower-class work fills a batch only as far as the
  time its oldest request has left allows, so filling a higher class's batch never takes
  it past its budget (the class's own waiting items are never cut for it); the time left
  counts the longest lower-class batch it may have waited for, which it does not see
  when the model computes on the event loop (the request is read only after that batch):
  the cap above left room for one item, so that is about what the fill may add. Both
  hold only for higher classes with traffic (a rate above :data:`ACTIVE_RATE_RPS`) and
  once the line is known.

**Units.** A batch is counted in its policy's budget unit
(:attr:`~carpool.core.policy.BatchPolicy.budget_unit`): items, or tokens under
``max_batch_tokens``, or cost under ``max_batch_cost``. Its time follows what limits it:
an embeddings batch of 64 short sentences computes faster than one of 8 long ones, so a
line fitted in items would be wrong both ways, and a cap in items would not bound the
time. Rates, the line, target sizes and caps are all in that unit; the scheduler applies
the cap as a budget in it.

Before :data:`COLD_BATCHES` batches were measured it behaves as a fixed window of
:data:`~carpool.core.policy.COLD_START_DELAY_S`. Everything reads the time passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from carpool.core.batch_times import BatchTimeFit
from carpool.core.policy import MAX_AUTO_DELAY_S, UNIT_ITEMS, BatchPolicy, ClassLimits
from carpool.core.returns import Returns

RATE_TAU_S = 0.5  # the arrival-rate counter forgets with this time constant
TARGET_UTILIZATION = 1.0  # rho: the share of the replica's time a target batch size uses
HYSTERESIS = 0.25  # a new target size replaces the one in force past this relative change
GAP_FACTOR = 2.0  # send when no arrival came for this many mean gaps
KNEE_SHARE = 0.1  # max_batch_size auto: overhead under this share of the per-item time
SLO_HEADROOM = 0.8  # the share of slo_s the controller plans with (the rest: hand-offs)
ACTIVE_RATE_RPS = 0.5  # a class slower than this is not protected by capping others
LOWER_MIN_SHARE = 0.25  # a capped lower-class batch holds at least this share of its cap
COLD_BATCHES = 8  # batches measured before the controller trusts its line
MIN_WAITING_S = 0.002  # waiting seen (decayed) before a company rate is trusted
FILL_STRETCH = 2.0  # preempting: a fill makes a batch at most this much slower than its own
REFUSING_SHARE = 0.01  # refused at admission past this share of arrivals: overloaded
ADMISSION_CAP_S = 0.005  # an admission check's cap is reused this long (1% of RATE_TAU_S)


class ArrivalRate:
    """Requests per second, as a counter that decays with time constant ``tau_s``: after
    a step from one steady rate to another, the estimate covers 95% of the step within
    three ``tau_s``."""

    __slots__ = ("_count", "_last_s", "_tau_s", "last_arrival_s")

    def __init__(self, tau_s: float = RATE_TAU_S) -> None:
        self._tau_s = tau_s
        self._count = 0.0
        self._last_s = 0.0
        self.last_arrival_s: float | None = None

    def note(self, now: float, num: float = 1.0) -> None:
        """``num`` arrived at ``now`` (requests, or their units)."""
        if now > self._last_s:
            self._count *= math.exp((self._last_s - now) / self._tau_s)
            self._last_s = now
        self._count += num
        if self.last_arrival_s is None or now > self.last_arrival_s:
            self.last_arrival_s = now

    def rate_rps(self, now: float) -> float:
        decay = math.exp(min(0.0, self._last_s - now) / self._tau_s)
        return self._count * decay / self._tau_s


class CompanyRate:
    """Arrivals per second over the time the class had a request waiting: the company a
    waiting request can expect. Both the arrivals counted and the waiting time decay with
    time constant ``tau_s``; 0 until :data:`MIN_WAITING_S` of waiting was seen."""

    __slots__ = ("_count", "_is_waiting", "_last_s", "_tau_s", "_waiting_s")

    def __init__(self, tau_s: float = RATE_TAU_S) -> None:
        self._tau_s = tau_s
        self._count = 0.0
        self._waiting_s = 0.0
        self._last_s = 0.0
        self._is_waiting = False

    def _advance(self, now: float) -> None:
        elapsed_s = now - self._last_s
        if elapsed_s > 0:
            keep = math.exp(-elapsed_s / self._tau_s)
            self._count *= keep
            self._waiting_s *= keep
            if self._is_waiting:
                self._waiting_s += elapsed_s
            self._last_s = now

    def note(self, now: float, had_company: bool, num: float = 1.0) -> None:
        """``num`` arrivals at ``now``; ``had_company``: one of the class was waiting."""
        self._advance(now)
        if had_company:
            self._count += num
        self._is_waiting = True

    def emptied(self, now: float) -> None:
        """The class has no request waiting any more (its last ones left in a batch)."""
        self._advance(now)
        self._is_waiting = False

    def rate_rps(self, now: float) -> float:
        self._advance(now)
        return 0.0 if self._waiting_s < MIN_WAITING_S else self._count / self._waiting_s


@dataclass(frozen=True, slots=True)
class ClassChoice:
    """What the controller has in force for one class: for ``/metrics`` and the policy."""

    name: str
    delay_s: float  # the window a lone request gets now
    batch_size: float  # the target size (the size cap when the delay is fixed), in the unit
    max_batch_size: float  # the most a batch led by this class may hold now, in the unit
    arrival_rate_rps: float  # requests per second
    company_rate_rps: float  # units per second arriving while one of the class waits
    closed_loop_share: float = 0.0  # of its landed batches, the share that came straight back
    refusing: bool = False  # over REFUSING_SHARE of its arrivals refused at admission


@dataclass(frozen=True, slots=True)
class AdaptiveState:
    """The controller's view: per class, and the fitted batch-time line; sizes, rates
    and the line's slope count :attr:`unit` (items, tokens or cost)."""

    classes: tuple[ClassChoice, ...]
    overhead_s: float
    per_item_s: float  # seconds per unit
    num_batches: int
    unit: str = UNIT_ITEMS
    stretch: float = 1.0  # a batch's span over the model's own time (BatchTimeFit.stretch)


class Adaptive:
    """The controller of one batcher (see the module docstring)."""

    __slots__ = (
        "_admission_caps",
        "_company",
        "_fit",
        "_rates",
        "_refused",
        "_returns",
        "_targets",
        "_units",
        "preempts",
    )

    def __init__(self, fit: BatchTimeFit) -> None:
        self._fit = fit
        # Higher classes run between a lower-class batch's steps: no class caps needed.
        self.preempts = False
        self._rates: dict[str, ArrivalRate] = {}  # requests
        self._units: dict[str, ArrivalRate] = {}  # units
        self._company: dict[str, CompanyRate] = {}  # units
        self._returns: dict[str, Returns] = {}  # requests
        self._refused: dict[str, ArrivalRate] = {}  # requests refused at admission
        self._targets: dict[str, float] = {}
        # class -> (policy, batches fitted, when, cap): see admission_cap
        self._admission_caps: dict[str, tuple[BatchPolicy, int, float, float]] = {}

    def forget(self) -> None:
        """Back to no traffic seen: rates, targets and returns counted in a budget unit the
        policy no longer has."""
        for table in (
            self._rates,
            self._units,
            self._company,
            self._returns,
            self._refused,
            self._targets,
            self._admission_caps,
        ):
            table.clear()

    def arrived(
        self,
        class_name: str,
        now: float,
        had_company: bool,
        num: int = 1,
        units: float | None = None,
    ) -> None:
        """``num`` requests of the class arrived, together ``units`` in the policy's
        budget unit (``num`` when None: a request is an item); ``had_company``: one was
        waiting."""
        units = float(num) if units is None else units
        rate = self._rates.get(class_name)
        if rate is None:
            rate = self._rates[class_name] = ArrivalRate()
            self._units[class_name] = ArrivalRate()
            self._company[class_name] = CompanyRate()
            self._returns[class_name] = Returns()
        rate.note(now, num)
        self._units[class_name].note(now, units)
        self._company[class_name].note(now, had_company, units)
        self._returns[class_name].arrived(now, num)

    def answered(self, now: float, requests_by_class: dict[str, int]) -> None:
        """A batch landed at ``now``, answering these requests of each class
        (:mod:`carpool.core.returns`: do their clients come straight back?). Requests,
        not units: each is a client that may come back, whatever its size; counted in
        tokens, a short text following a long one read as most of a client still on its
        way, and a lone client under ``max_batch_tokens`` waited for it."""
        for class_name, num in requests_by_class.items():
            returns = self._returns.get(class_name)
            if returns is not None:
                returns.answered(now, num)

    def refused(self, class_name: str, now: float, units: float = 1.0) -> None:
        """A request of the class, of ``units`` in the budget unit, was refused at
        admission (a queue bound)."""
        rate = self._refused.get(class_name)
        if rate is None:
            rate = self._refused[class_name] = ArrivalRate()
        rate.note(now, units)

    def refused_rps(self, class_name: str, now: float) -> float:
        """Units of the class refused at admission per second, lately."""
        refused = self._refused.get(class_name)
        return 0.0 if refused is None else refused.rate_rps(now)

    def is_refusing(self, class_name: str, now: float) -> bool:
        """Whether more than :data:`REFUSING_SHARE` of the class's recent arrivals (in
        units) were refused at admission: more comes than its queue bound lets wait."""
        refused_rps = self.refused_rps(class_name, now)
        if refused_rps <= 0.0:
            return False
        return refused_rps > REFUSING_SHARE * (refused_rps + self.units_rps(class_name, now))

    def closed_loop_share(self, class_name: str) -> float:
        """The share of the class's landed batches that came straight back (moving average)."""
        returns = self._returns.get(class_name)
        return 0.0 if returns is None else returns.share

    def emptied(self, class_name: str, now: float) -> None:
        """No request of the class waits any more."""
        company = self._company.get(class_name)
        if company is not None:
            company.emptied(now)

    def rate_rps(self, class_name: str, now: float) -> float:
        """All arrivals of the class, requests per second."""
        rate = self._rates.get(class_name)
        return 0.0 if rate is None else rate.rate_rps(now)

    def units_rps(self, class_name: str, now: float) -> float:
        """All arrivals of the class, in the budget unit per second."""
        units = self._units.get(class_name)
        return 0.0 if units is None else units.rate_rps(now)

    def company_rps(self, class_name: str, now: float) -> float:
        """Units arriving per second while one of the class waits (:class:`CompanyRate`),
        at most the overall rate: over HTTP, arrivals bunch while requests wait (answers
        leave together, their clients send together), and W1 under Poisson load saw
        twice the overall rate while waiting, which made the targets twice too large."""
        company = self._company.get(class_name)
        if company is None:
            return 0.0
        return min(company.rate_rps(now), self.units_rps(class_name, now))

    def one_request(self, class_name: str, now: float) -> float:
        """What a lone request of the class brings, in the budget unit: its mean over the
        recent arrivals (1.0 before any), which may be under 1 (a cost of 0.25)."""
        requests = self.rate_rps(class_name, now)
        units = self.units_rps(class_name, now)
        return units / requests if requests > 0.0 and units > 0.0 else 1.0

    def request_units(self, class_name: str, now: float) -> float:
        """The class's mean request in the budget unit, over its recent arrivals (1.0
        before any)."""
        requests = self.rate_rps(class_name, now)
        if requests <= 0.0:
            return 1.0
        return max(1.0, self.units_rps(class_name, now) / requests)

    @property
    def is_warm(self) -> bool:
        return self._fit.num_batches >= COLD_BATCHES

    # -- the size ------------------------------------------------------------------

    def max_units(
        self,
        policy: BatchPolicy,
        limits: ClassLimits,
        oldest_arrival_s: float,
        now: float,
        num_own_units: float = 1.0,
    ) -> float:
        """The most a batch led by class ``limits`` may hold now, in the policy's budget
        unit: at least 1, at most the class's limit in it
        (:meth:`~carpool.core.policy.BatchPolicy.unit_limit`). The time its oldest
        request has left limits only the lower-class fill: the class's own
        ``num_own_units`` waiting are never cut for it (a backlog run one by one would
        only grow)."""
        cap = policy.unit_limit(limits)
        if not self.is_warm:
            return cap
        # Before the sizes seen varied, the line is the mean time per item, no overhead:
        # it has no knee, but it does tell the class caps below what a batch costs (a
        # saturated replica that only ever ran full batches would never cap one else).
        overhead_s, per_item_s = self._fit.line()
        knee_per_item_s = KNEE_SHARE * per_item_s  # 0 for a subnormal per_item_s too
        if limits.is_auto_size and knee_per_item_s > 0 and self._fit.is_identified:
            knee = overhead_s / knee_per_item_s
            # Past the knee a larger batch only adds latency while the replica keeps up;
            # when it does not, the size that keeps up is the floor (else the queue grows).
            # What a queue bound refused is demand too: from the admitted rate alone, a
            # cap that refuses most of the load would keep itself small (a day/night
            # schedule ran in batches of one, the rest refused).
            rate = self.company_rps(limits.name, now) + self.refused_rps(limits.name, now)
            knee = max(knee, _keep_up_size(rate, overhead_s, per_item_s, cap))
            cap = min(cap, max(1.0, math.ceil(min(knee, cap))))
        for higher in policy.limits.values():
            if self.preempts or higher.rank >= limits.rank or higher.slo_s is None:
                continue
            if self.rate_rps(higher.name, now) < ACTIVE_RATE_RPS:
                continue
            own = self.request_units(higher.name, now)
            cap = min(cap, _lower_cap(higher.slo_s, overhead_s, per_item_s, cap, own))
        if limits.slo_s is not None:
            # No batch whose compute alone would take it past its budget.
            budget_s = SLO_HEADROOM * limits.slo_s
            cap = min(cap, _largest_within(budget_s, overhead_s, per_item_s))
            if limits.bounds_queue_time and self.is_refusing(limits.name, now):
                # Overloaded, the excess refused: a request admitted as a batch starts
                # waits for it, then rides the next. Two batches, at the time they
                # really span, within the budget.
                stretch = self._fit.stretch
                two = _largest_within(budget_s / 2, overhead_s * stretch, per_item_s * stretch)
                cap = min(cap, two)
            waited_s = max(now - oldest_arrival_s, self._lower_wait_s(policy, limits, now))
            within = _largest_within(budget_s - waited_s, overhead_s, per_item_s)
            if self.preempts and self._has_lower_traffic(policy, limits, now):
                own_s = overhead_s + per_item_s * num_own_units
                within = min(within, _largest_within(FILL_STRETCH * own_s, overhead_s, per_item_s))
            cap = min(cap, max(within, num_own_units))
        return cap

    def admission_cap(self, policy: BatchPolicy, limits: ClassLimits, now: float) -> float:
        """:meth:`max_units` for a batch led by a request arriving now, as the queue bound
        in time asks it at every admission (:mod:`carpool.core.queue_time`): the same
        answer is reused for :data:`ADMISSION_CAP_S`, until a batch lands or the policy
        changes. What it reads moves slowly next to that (the rates by about 1% in that time),
        and under overload, where every admission asks, computing it afresh (about 10 µs)
        took W1 about 4% of its event loop's time (docs/benchmarks.md)."""
        held = self._admission_caps.get(limits.name)
        num_batches = self._fit.num_batches
        if held is not None:
            held_policy, held_batches, held_s, cap = held
            fresh = 0.0 <= now - held_s < ADMISSION_CAP_S
            if held_policy is policy and held_batches == num_batches and fresh:
                return cap
        cap = self.max_units(policy, limits, now, now)
        self._admission_caps[limits.name] = (policy, num_batches, now, cap)
        return cap

    def _has_lower_traffic(self, policy: BatchPolicy, limits: ClassLimits, now: float) -> bool:
        return any(
            c.rank > limits.rank and self.rate_rps(c.name, now) >= ACTIVE_RATE_RPS
            for c in policy.limits.values()
        )

    def _lower_wait_s(self, policy: BatchPolicy, limits: ClassLimits, now: float) -> float:
        """The longest a request of class ``limits`` may have waited for a lower-class
        batch: the largest one capped for its sake (0 when no lower class has traffic,
        or it has none itself). A request of a model that computes on the event loop's
        thread is read only after that batch, so its own arrival time does not show this
        wait: its batch's fill must leave room for it."""
        assert limits.slo_s is not None, "only a class with a budget caps the others"
        if self.preempts or self.rate_rps(limits.name, now) < ACTIVE_RATE_RPS:
            return 0.0
        lower = [
            policy.unit_limit(c)
            for c in policy.limits.values()
            if c.rank > limits.rank and self.rate_rps(c.name, now) >= ACTIVE_RATE_RPS
        ]
        if not lower:
            return 0.0
        overhead_s, per_item_s = self._fit.line()
        most = max(lower)
        own = self.request_units(limits.name, now)
        largest = min(most, _lower_cap(limits.slo_s, overhead_s, per_item_s, most, own))
        return overhead_s + per_item_s * largest

    # -- the delay -----------------------------------------------------------------

    def target_size(
        self, limits: ClassLimits, max_items: float, now: float, one: float | None = None
    ) -> float:
        """The batch size worth waiting for at the class's rate now (module docstring);
        ``one``: :meth:`one_request`, when the caller has it."""
        rate = self.company_rps(limits.name, now)
        overhead_s, per_item_s = self._fit.line()
        if one is None:
            one = self.one_request(limits.name, now)
        wanted = _keep_up_size(rate, overhead_s, per_item_s, max_items, one)
        held = self._targets.get(limits.name)
        if held is not None and abs(wanted - held) <= HYSTERESIS * held:
            wanted = min(held, max_items)
        else:
            self._targets[limits.name] = wanted
        return wanted

    def due_s(
        self,
        limits: ClassLimits,
        num_items: float,
        max_items: float,
        oldest_arrival_s: float,
        now: float,
    ) -> float:
        """When a batch of class ``limits`` now holding ``num_items`` (of at most
        ``max_items``, both in the budget unit) should go: ``now`` or earlier means at
        once. Never later than :meth:`budget_s` after its oldest request's arrival."""
        if not self.is_warm:
            return oldest_arrival_s + limits.max_delay_s
        one = self.one_request(limits.name, now)
        target = self.target_size(limits, max_items, now, one)
        returns = self._returns.get(limits.name)
        back = 0.0 if returns is None else returns.pending(now)  # requests
        if returns is not None and back >= 1.0 and num_items + one <= max_items:
            # A closed loop's clients are on their way back: wait for them, not the rate.
            wanted = min(max_items, num_items + back * one)
            return min(returns.window_end_s, oldest_arrival_s + self.budget_s(limits, wanted))
        if num_items >= target:
            return now
        rate = self._rates.get(limits.name)
        rate_rps = self.company_rps(limits.name, now)
        if rate is None or rate_rps <= 0.0 or rate.last_arrival_s is None:
            return now
        if _keeps_up_alone(rate_rps, *self._fit.line(), one):
            # Requests one at a time keep up: company buys nothing. Under tokens or cost a
            # request smaller than the mean one (the target's floor) would else wait for it.
            return now
        due = now + (target - num_items) / rate_rps
        # The rate is in units: a mean gap between requests is one request's units over it.
        gap_s = one / rate_rps
        due = min(due, rate.last_arrival_s + GAP_FACTOR * gap_s)
        return min(due, oldest_arrival_s + self.budget_s(limits, target))

    def _lone_delay_s(
        self, limits: ClassLimits, max_items: float, now: float
    ) -> tuple[float, float]:
        """(the window a request arriving now alone would get, the target it waits for):
        :meth:`due_s` for it, from the rates as they are now (what a scrape shows must not
        be a target held from traffic that has gone), without moving the held target."""
        one = self.one_request(limits.name, now)
        rate_rps = self.company_rps(limits.name, now)
        overhead_s, per_item_s = self._fit.line()
        target = _keep_up_size(rate_rps, overhead_s, per_item_s, max_items, one)
        if one >= target or rate_rps <= 0.0:
            return 0.0, target
        # Its own arrival is the class's last: the gap rule counts from now.
        wait_s = min((target - one) / rate_rps, GAP_FACTOR * one / rate_rps)
        return max(0.0, min(wait_s, self.budget_s(limits, target))), target

    def budget_s(self, limits: ClassLimits, num_items: float) -> float:
        """The longest the oldest request of a batch of ``num_items`` may wait for
        company: its ``slo_s`` less the batch's predicted compute, at most
        :data:`~carpool.core.policy.MAX_AUTO_DELAY_S` (0 when nothing is left)."""
        if limits.slo_s is None:
            return MAX_AUTO_DELAY_S
        left_s = limits.slo_s - self._fit.predict_s(num_items)
        return min(MAX_AUTO_DELAY_S, max(0.0, left_s))

    # -- what is in force ----------------------------------------------------------

    def state(self, policy: BatchPolicy, now: float) -> AdaptiveState:
        choices = []
        for limits in policy.limits.values():
            max_items = self.max_units(policy, limits, now, now)
            rate_rps = self.company_rps(limits.name, now)
            if not limits.is_auto_delay or not self.is_warm:
                delay_s, target = limits.max_delay_s, max_items
            else:
                delay_s, target = self._lone_delay_s(limits, max_items, now)
            arrival_rps = self.rate_rps(limits.name, now)
            share = self.closed_loop_share(limits.name)
            refusing = self.is_refusing(limits.name, now)
            choices.append(
                ClassChoice(
                    limits.name, delay_s, target, max_items, arrival_rps, rate_rps, share, refusing
                )
            )
        overhead_s, per_item_s = self._fit.line()
        fit = self._fit
        return AdaptiveState(
            tuple(choices), overhead_s, per_item_s, fit.num_batches, policy.budget_unit, fit.stretch
        )


def _keep_up_size(
    rate_rps: float, overhead_s: float, per_item_s: float, max_items: float, one: float = 1.0
) -> float:
    """The smallest batch that keeps the replica at most TARGET_UTILIZATION busy at
    ``rate_rps`` (``max_items`` when none does), in [one, max_items]: ``one`` request's
    units at least (``max_items`` where that is less), so at low load a lone request goes
    at once whatever its size in the unit."""
    rho = TARGET_UTILIZATION
    low = min(one, max_items)
    if _keeps_up_alone(rate_rps, overhead_s, per_item_s, one):
        return low
    if rate_rps * per_item_s >= rho:
        return max_items
    wanted = math.ceil(min(max_items, rate_rps * overhead_s / (rho - rate_rps * per_item_s)))
    return min(max_items, max(low, wanted))


def _keeps_up_alone(rate_rps: float, overhead_s: float, per_item_s: float, one: float) -> bool:
    """Whether requests sent one at a time (``one`` unit each) keep the replica at most
    TARGET_UTILIZATION busy at ``rate_rps`` units a second: r t(one) / one <= rho."""
    return rate_rps * (overhead_s + per_item_s * one) <= TARGET_UTILIZATION * one


def _lower_cap(
    slo_s: float, overhead_s: float, per_item_s: float, max_items: float, own_units: float
) -> float:
    """The largest lower-class batch (of at most ``max_items``) after which a
    higher-class arrival of ``own_units`` (budget from ``slo_s``) still runs in time, but
    at least :data:`LOWER_MIN_SHARE` of ``max_items`` (module docstring)."""
    allowed_s = SLO_HEADROOM * slo_s - (overhead_s + per_item_s * own_units)
    floor = math.ceil(LOWER_MIN_SHARE * max_items)
    return min(max_items, max(floor, _largest_within(allowed_s, overhead_s, per_item_s)))


def _largest_within(allowed_s: float, overhead_s: float, per_item_s: float) -> int:
    """The largest batch whose predicted time is within ``allowed_s`` (at least 1)."""
    if per_item_s <= 0:
        return _UNBOUNDED if overhead_s <= allowed_s else 1
    items = (allowed_s - overhead_s) / per_item_s
    return max(1, math.floor(min(_UNBOUNDED, max(0.0, items))))


_UNBOUNDED = 1 << 30  # more items than any batch holds
