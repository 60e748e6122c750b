"""The adaptive controller: its decisions from a known batch-time line and arrivals, its
bounds (never past the budget it computed, never past the size caps), and its behaviour
in a simulated serving loop (settles under noise, follows a step in the arrival rate)."""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.adaptive import (
    ADMISSION_CAP_S,
    COLD_BATCHES,
    FILL_STRETCH,
    GAP_FACTOR,
    KNEE_SHARE,
    LOWER_MIN_SHARE,
    SLO_HEADROOM,
    TARGET_UTILIZATION,
    Adaptive,
    AdaptiveState,
    ArrivalRate,
    ClassChoice,
    CompanyRate,
    _keep_up_size,
)
from carpool.core.batch_times import BatchTimeFit
from carpool.core.policy import (
    COLD_START_DELAY_S,
    MAX_AUTO_DELAY_S,
    UNIT_COST,
    BatchPolicy,
    ClassPolicy,
)
from carpool.core.queues import Queues
from carpool.core.request import Request
from carpool.core.returns import CLOSED_LOOP_SHARE
from carpool.core.scheduler import Decision, Scheduler
from carpool.errors import ConfigError

OVERHEAD_S, PER_ITEM_S = 0.002, 0.0003


def _fit(overhead_s: float = OVERHEAD_S, per_item_s: float = PER_ITEM_S) -> BatchTimeFit:
    fit = BatchTimeFit()
    for size in [1, 2, 4, 8, 16, 32, 64] * 2:
        fit.observe(size, overhead_s + per_item_s * size)
    return fit


def _decide(now: float, policy: BatchPolicy, queues: Queues, adaptive: Adaptive) -> Decision:
    """One free replica's decision under the controller."""
    return Scheduler().decide(
        now,
        policy,
        queues,
        num_replicas=1,
        max_items_cap=None,
        is_draining=False,
        expire=lambda r: None,
        adaptive=adaptive,
    )


def _steady(
    adaptive: Adaptive, name: str, rate_rps: float, until_s: float, start_s: float = 0.0
) -> None:
    """Arrivals of class ``name`` every 1/rate seconds from ``start_s`` up to ``until_s``,
    each finding one of its class waiting (open-loop traffic, as a waiting request sees
    it)."""
    gap_s = 1.0 / rate_rps
    for i in range(int((until_s - start_s) / gap_s) + 1):
        adaptive.arrived(name, start_s + i * gap_s, True)


# -- the pieces: arrival rate and batch-time line --------------------------------------


def test_the_arrival_rate_converges_to_a_steady_rate() -> None:
    rate = ArrivalRate()
    for i in range(5001):
        rate.note(i * 0.001)
    assert rate.rate_rps(5.0) == pytest.approx(1000, rel=0.01)


def test_the_arrival_rate_decays_when_arrivals_stop() -> None:
    rate = ArrivalRate(tau_s=1.0)
    for i in range(5001):
        rate.note(i * 0.001)
    assert rate.rate_rps(8.0) == pytest.approx(1000 * math.exp(-3), rel=0.02)


def test_the_company_rate_counts_only_arrivals_that_find_one_waiting() -> None:
    # Open loop: 1000 rps, a batch taken every 4 ms: arrivals find company 3 times in 4.
    open_loop = CompanyRate()
    for i in range(4000):
        open_loop.note(i * 0.001, had_company=i % 4 != 0)
        if i % 4 == 3:
            open_loop.emptied(i * 0.001)
    assert open_loop.rate_rps(4.0) == pytest.approx(1000, rel=0.05)
    # Closed loop, one client: 300 rps, each request alone, taken at once.
    closed = CompanyRate()
    for i in range(1200):
        closed.note(i / 300, had_company=False)
        closed.emptied(i / 300 + 0.00005)
    assert closed.rate_rps(4.0) == 0.0


def test_a_lone_closed_loop_client_is_never_kept_waiting() -> None:
    adaptive = Adaptive(_fit(overhead_s=0.05, per_item_s=0.001))  # a slow model
    limits = _policy(slo_s=1.0).class_limits(None)
    t = 0.0
    for _ in range(100):  # each request answered 51 ms later, the next sent 1 ms after
        adaptive.arrived(limits.name, t, False)
        assert adaptive.due_s(limits, 1, 64, t, t) == t
        adaptive.emptied(limits.name, t)
        t += 0.052


def test_the_fit_recovers_a_line() -> None:
    overhead_s, per_item_s = _fit().line()
    assert overhead_s == pytest.approx(OVERHEAD_S)
    assert per_item_s == pytest.approx(PER_ITEM_S)


def test_the_fit_of_one_size_only_charges_every_item_its_mean() -> None:
    fit = BatchTimeFit()
    for _ in range(10):
        fit.observe(4, 0.004)
    assert not fit.is_identified
    assert fit.line() == pytest.approx((0.0, 0.001))


def test_the_fit_follows_a_model_that_slows_down() -> None:
    fit = _fit()
    for i in range(300):
        size = 1 << (i % 7)
        fit.observe(size, 2 * (OVERHEAD_S + PER_ITEM_S * size))
    assert fit.predict_s(32) == pytest.approx(2 * (OVERHEAD_S + PER_ITEM_S * 32), rel=0.05)


def test_the_fit_keeps_its_slope_once_the_sizes_stop_varying() -> None:
    fit = _fit()
    # A saturated replica: full batches only, for far longer than the fit remembers,
    # then on a model 1 ms slower per batch: the overhead follows.
    for _ in range(1000):
        fit.observe(64, OVERHEAD_S + PER_ITEM_S * 64)
    assert fit.is_identified
    assert fit.line() == pytest.approx((OVERHEAD_S, PER_ITEM_S))
    for _ in range(1000):
        fit.observe(64, OVERHEAD_S + 0.001 + PER_ITEM_S * 64)
    overhead_s, per_item_s = fit.line()
    assert per_item_s == pytest.approx(PER_ITEM_S)
    assert overhead_s == pytest.approx(OVERHEAD_S + 0.001)


@pytest.mark.parametrize("seed", range(10))
def test_a_narrow_noisy_cluster_of_sizes_leaves_the_slope_it_found_before(seed: int) -> None:
    """A closed loop of 16 clients runs batches of 16, now and then 12-15, whose times
    vary by more than what a few items cost: the slope they give could be anything (over
    HTTP a line of 7.01 ms + 0 ms an item was fitted after such a load: the knee at
    infinity). The slope the varied sizes gave before stays within what the cluster can
    tell; the overhead follows."""
    rng = random.Random(seed)
    fit = _fit()
    for _ in range(2000):
        size = 16 if rng.random() < 0.7 else rng.randint(12, 15)
        fit.observe(size, OVERHEAD_S + PER_ITEM_S * size + rng.gauss(0.0, 0.001))
    overhead_s, per_item_s = fit.line()
    assert per_item_s == pytest.approx(PER_ITEM_S, rel=0.25)
    assert overhead_s == pytest.approx(OVERHEAD_S, abs=0.0015)


def test_varied_sizes_with_noisy_times_still_give_the_slope() -> None:
    rng = random.Random(4)
    fit = BatchTimeFit()
    for i in range(400):
        size = 1 << (i % 7)
        fit.observe(size, OVERHEAD_S + PER_ITEM_S * size + rng.gauss(0.0, 0.0005))
    assert fit.is_identified
    overhead_s, per_item_s = fit.line()
    assert per_item_s == pytest.approx(PER_ITEM_S, rel=0.1)
    assert overhead_s == pytest.approx(OVERHEAD_S, abs=0.0005)


def test_a_model_whose_time_does_not_grow_with_the_batch_gets_a_flat_line() -> None:
    """A GPU far from its limit: 5 ms whatever the size. A slope of about 0 is a known
    slope (no knee), not an unknown one (each item charged the mean)."""
    rng = random.Random(5)
    fit = BatchTimeFit()
    for i in range(400):
        fit.observe(1 << (i % 7), 0.005 + rng.gauss(0.0, 0.0002))
    assert fit.is_identified
    overhead_s, per_item_s = fit.line()
    assert per_item_s < 0.00002 and overhead_s == pytest.approx(0.005, abs=0.0003)


# -- decisions on a known line and known arrivals -------------------------------------


def _policy(**changes: object) -> BatchPolicy:
    fields: dict[str, object] = {"max_delay_s": "auto", "max_batch_size": 64, "slo_s": 0.05}
    fields.update(changes)
    return BatchPolicy(**fields)  # type: ignore[arg-type]


def test_cold_it_behaves_as_a_small_fixed_window() -> None:
    fit = BatchTimeFit()
    adaptive = Adaptive(fit)
    limits = _policy().class_limits(None)
    adaptive.arrived(limits.name, 1.0, False)
    assert adaptive.due_s(limits, 1, 64, 1.0, 1.0) == 1.0 + COLD_START_DELAY_S
    for _ in range(COLD_BATCHES):
        fit.observe(1, OVERHEAD_S)
    assert adaptive.due_s(limits, 1, 64, 1.0, 1.0) == 1.0  # warm, low rate: at once


def test_at_low_rate_a_lone_request_goes_at_once() -> None:
    adaptive = Adaptive(_fit())
    limits = _policy().class_limits(None)
    _steady(adaptive, limits.name, 100, until_s=5.0)  # 100 rps x 2.3 ms: 23% busy
    assert adaptive.target_size(limits, 64, 5.0) == 1
    assert adaptive.due_s(limits, 1, 64, 5.0, 5.0) == 5.0


def test_at_high_rate_it_waits_for_the_size_that_keeps_the_replica_under_rho() -> None:
    adaptive = Adaptive(_fit())
    limits = _policy().class_limits(None)
    _steady(adaptive, limits.name, 2000, until_s=5.0)
    now = 5.0
    rate_rps = adaptive.company_rps(limits.name, now)
    # r * (a / b + c) <= rho  ->  b >= r a / (rho - r c): 2000 * 0.002 / 0.4 = 10 at 2000
    rho = TARGET_UTILIZATION
    target = math.ceil(rate_rps * OVERHEAD_S / (rho - rate_rps * PER_ITEM_S))
    assert target in (10, 11)
    assert adaptive.target_size(limits, 64, now) == target
    due = adaptive.due_s(limits, target - 1, 64, now - 0.002, now)
    assert due == pytest.approx(now + 1 / rate_rps)
    assert adaptive.due_s(limits, target, 64, now - 0.003, now) == now


def test_it_sends_when_no_arrival_came_for_a_few_mean_gaps() -> None:
    adaptive = Adaptive(_fit())
    limits = _policy().class_limits(None)
    _steady(adaptive, limits.name, 1000, until_s=5.0)  # the last at 5.0
    now = 5.0
    # 1 of 4 queued: the rate says 3 ms more; the gap rule says 2 mean gaps (2 ms).
    due = adaptive.due_s(limits, 1, 64, now, now)
    assert due == pytest.approx(5.0 + GAP_FACTOR / adaptive.company_rps(limits.name, now))


def test_it_never_waits_past_the_slo_less_the_predicted_compute() -> None:
    adaptive = Adaptive(_fit())
    limits = _policy(slo_s=0.005).class_limits(None)
    _steady(adaptive, limits.name, 3000, until_s=5.0)
    now = 5.0
    target = adaptive.target_size(limits, 64, now)
    assert target > 1
    budget_s = 0.005 - (OVERHEAD_S + PER_ITEM_S * target)
    assert adaptive.budget_s(limits, target) == pytest.approx(max(0.0, budget_s))
    oldest_s = now - 0.001
    assert adaptive.due_s(limits, 1, 64, oldest_s, now) <= oldest_s + max(0.0, budget_s) + 1e-12


def test_auto_batch_size_is_the_knee_of_the_line() -> None:
    adaptive = Adaptive(_fit())
    limits = _policy(max_batch_size="auto").class_limits(None)
    knee = math.ceil(OVERHEAD_S / (KNEE_SHARE * PER_ITEM_S))  # 67
    assert adaptive.max_units(_policy(max_batch_size="auto"), limits, 0.0, 0.0) == knee
    flat = Adaptive(_fit(per_item_s=0.0))  # a GPU below its width: no knee, the limit
    assert flat.max_units(_policy(max_batch_size="auto"), limits, 0.0, 0.0) == 256


def test_auto_batch_size_is_never_below_the_size_that_keeps_up() -> None:
    adaptive = Adaptive(_fit())
    policy = _policy(max_batch_size="auto", slo_s=1.0)
    limits = policy.class_limits(None)
    _steady(adaptive, limits.name, 3200, until_s=5.0)  # r c = 0.96: b >= r a / (rho - r c)
    rate_rps = adaptive.company_rps(limits.name, 5.0)
    rho = TARGET_UTILIZATION
    keep_up = math.ceil(rate_rps * OVERHEAD_S / (rho - rate_rps * PER_ITEM_S))
    assert keep_up > 67  # past the knee
    assert adaptive.max_units(policy, limits, 5.0, 5.0) == min(256, keep_up)


def test_refusing_under_a_queue_bound_it_caps_at_two_batches_within_the_budget() -> None:
    policy = _policy(max_batch_size=256, slo_s=0.05, max_queue_time_s="auto")
    limits = policy.class_limits(None)
    budget_s = SLO_HEADROOM * 0.05
    one = math.floor((budget_s - OVERHEAD_S) / PER_ITEM_S)  # 126: one batch in the budget
    two = math.floor((budget_s / 2 - OVERHEAD_S) / PER_ITEM_S)  # 60: two of them
    fit = _fit()
    adaptive = Adaptive(fit)
    _steady(adaptive, limits.name, 3000, until_s=5.0)
    assert adaptive.max_units(policy, limits, 5.0, 5.0) == one
    for i in range(20):  # 20 of about 1,500 arrivals in half a second: refusing
        adaptive.refused(limits.name, 5.0 + i * 0.001)
    now = 5.02
    assert adaptive.is_refusing(limits.name, now)
    assert adaptive.max_units(policy, limits, now, now) == two
    shown = {c.name: c.refusing for c in adaptive.state(policy, now).classes}
    assert shown == {"interactive": False, "normal": True, "background": False}
    # Batches that span 1.25x the model's own time (the loop's work between steps).
    for _ in range(50):
        fit.note_stretch(0.0125, 0.01)
    stretched = math.floor((budget_s / 2 / fit.stretch - OVERHEAD_S) / PER_ITEM_S)
    assert stretched < two
    assert adaptive.max_units(policy, limits, now, now) == stretched
    assert adaptive.state(policy, now).stretch == fit.stretch
    # Admitted again, the refusals age out (a time constant of half a second).
    _steady(adaptive, limits.name, 3000, until_s=now + 5.0, start_s=now)
    assert not adaptive.is_refusing(limits.name, now + 5.0)
    assert adaptive.max_units(policy, limits, now + 5.0, now + 5.0) == one
    # Without a queue bound in time, refusals (a count bound) leave the cap alone.
    unbounded = _policy(max_batch_size=256, slo_s=0.05, max_queue_size=10)
    assert adaptive.max_units(unbounded, unbounded.class_limits(None), now, now) == one


def test_the_admission_cap_is_reused_briefly_and_never_past_a_batch_or_a_new_policy() -> None:
    policy = _policy(max_batch_size=256, slo_s=0.05, max_queue_time_s="auto")
    limits = policy.class_limits(None)
    fit = _fit()
    adaptive = Adaptive(fit)
    _steady(adaptive, limits.name, 3000, until_s=5.0)
    one = adaptive.max_units(policy, limits, 5.0, 5.0)
    tighter = policy.replace(max_batch_size=4)  # a new policy asks afresh, however soon
    assert adaptive.admission_cap(tighter, tighter.class_limits(None), 5.0) == 4
    assert adaptive.admission_cap(policy, limits, 5.0) == one
    for i in range(20):  # refusing from here on: the cap in force falls to two batches
        adaptive.refused(limits.name, 5.0 + i * 0.0001)
    now = 5.002
    two = adaptive.max_units(policy, limits, now, now)
    assert two < one
    assert adaptive.admission_cap(policy, limits, now) == one  # within ADMISSION_CAP_S
    assert adaptive.admission_cap(policy, limits, 5.0 + 1.01 * ADMISSION_CAP_S) == two
    # A batch landing (the line changed) asks afresh, however soon.
    later = 5.0 + 1.02 * ADMISSION_CAP_S
    assert adaptive.admission_cap(policy, limits, later) == two
    fit.observe(8, 0.2)  # much slower batches: a smaller cap
    slower = adaptive.max_units(policy, limits, later, later)
    assert slower < two
    assert adaptive.admission_cap(policy, limits, later) == slower


def test_what_a_queue_bound_refuses_counts_as_demand_for_the_size_that_keeps_up() -> None:
    """A line fitted on batches of one only (no overhead seen: the knee is 0) and a queue
    bound refusing most of the load: from the admitted rate alone the size that keeps up
    was 1, the cap stayed at 1 and the bound kept refusing (a day/night schedule)."""
    fit = BatchTimeFit()
    for size in [1, 2, 4, 8, 16, 32, 64] * 4:  # a steep slope, identified once
        fit.observe(size, 0.003 * size)
    for _ in range(300):  # then batches of one only, faster than that slope says
        fit.observe(1, 0.0025)
    overhead_s, per_item_s = fit.line()
    assert fit.is_identified and overhead_s == 0.0  # the knee is 0: keep-up is the floor
    policy = _policy(max_batch_size="auto", slo_s=0.05, max_queue_time_s="auto")
    limits = policy.class_limits(None)
    adaptive = Adaptive(fit)
    _steady(adaptive, limits.name, 160, until_s=5.0)  # admitted: 0.4 of one item a time
    for i in range(int(5.0 * 2400)):  # refused: 2,400 a second
        adaptive.refused(limits.name, i / 2400)
    now = 5.0
    assert adaptive.is_refusing(limits.name, now)
    # Two batches in the budget on the line's own slope, not 1 item a batch.
    two = math.floor((SLO_HEADROOM * 0.05 / 2) / per_item_s)
    assert two >= 6
    assert adaptive.max_units(policy, limits, now, now) == two


def test_lower_class_batches_are_capped_while_a_higher_class_has_traffic() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    adaptive = Adaptive(_fit())
    background = policy.class_limits("background")
    assert adaptive.max_units(policy, background, 5.0, 5.0) == 128  # nobody to protect
    _steady(adaptive, "interactive", 50, until_s=5.0)
    # Its batch plus one interactive item within 80% of 20 ms.
    allowed_s = SLO_HEADROOM * 0.02 - (OVERHEAD_S + PER_ITEM_S)
    expected = math.floor((allowed_s - OVERHEAD_S) / PER_ITEM_S)
    assert adaptive.max_units(policy, background, 5.0, 5.0) == expected
    assert OVERHEAD_S + PER_ITEM_S * expected + OVERHEAD_S + PER_ITEM_S <= 0.016 + 1e-12


def test_while_higher_classes_preempt_lower_class_batches_are_not_capped() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    adaptive = Adaptive(_fit())
    _steady(adaptive, "interactive", 50, until_s=5.0)
    _steady(adaptive, "background", 2000, until_s=5.0)
    background = policy.class_limits("background")
    interactive = policy.class_limits("interactive")
    assert adaptive.max_units(policy, background, 5.0, 5.0) < 128
    assert adaptive.max_units(policy, interactive, 5.0, 5.0) == 1  # room for the wait
    # An interactive request now waits one step of a background batch, not the batch;
    # the fill takes its batch to at most twice the time of its own items.
    adaptive.preempts = True
    assert adaptive.max_units(policy, background, 5.0, 5.0) == 128
    for own in (1, 3):
        stretched = math.floor(
            (FILL_STRETCH * (OVERHEAD_S + PER_ITEM_S * own) - OVERHEAD_S) / PER_ITEM_S
        )
        alone_fits = math.floor((SLO_HEADROOM * 0.02 - OVERHEAD_S) / PER_ITEM_S)
        assert stretched < alone_fits
        assert adaptive.max_units(policy, interactive, 5.0, 5.0, own) == stretched


def test_a_model_too_slow_for_the_promise_keeps_lower_class_batches_worth_running() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    # A noisy neighbour: 7 ms per batch + 0.3 ms per item. A background batch and one
    # interactive item fit 16 ms only up to 5 items, 82% of their time overhead; the
    # cap stops at a quarter of the 128 allowed.
    adaptive = Adaptive(_fit(overhead_s=0.007))
    _steady(adaptive, "interactive", 50, until_s=5.0)
    background = policy.class_limits("background")
    assert adaptive.max_units(policy, background, 5.0, 5.0) == LOWER_MIN_SHARE * 128
    # And the interactive fill leaves room for that batch: none is left.
    _steady(adaptive, "background", 2000, until_s=5.0)
    assert adaptive.max_units(policy, policy.class_limits("interactive"), 5.0, 5.0) == 1


def test_lower_class_batches_are_capped_before_the_sizes_seen_ever_varied() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    fit = BatchTimeFit()
    for _ in range(50):  # straight into saturation: full batches only, 20 ms each
        fit.observe(64, 0.020)
    assert not fit.is_identified
    adaptive = Adaptive(fit)
    _steady(adaptive, "interactive", 50, until_s=5.0)
    # No overhead known: each item costs 20/64 ms; its batch plus one item within 16 ms.
    per_item_s = 0.020 / 64
    expected = math.floor((SLO_HEADROOM * 0.02 - per_item_s) / per_item_s)
    assert adaptive.max_units(policy, policy.class_limits("background"), 5.0, 5.0) == expected


def test_lower_class_fill_goes_only_as_far_as_the_oldest_request_has_time_left() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    adaptive = Adaptive(_fit())
    interactive = policy.class_limits("interactive")
    now = 5.0
    waited_s = 0.010  # behind a running batch
    left_s = SLO_HEADROOM * 0.02 - waited_s
    expected = math.floor((left_s - OVERHEAD_S) / PER_ITEM_S)
    assert adaptive.max_units(policy, interactive, now - waited_s, now) == expected
    assert adaptive.max_units(policy, interactive, now - 1.0, now) == 1  # late: no fill
    # Its own backlog is never cut for it: run one by one, a backlog would only grow;
    # only by the batch whose compute alone fits its budget.
    assert adaptive.max_units(policy, interactive, now - 1.0, now, num_own_units=30) == 30
    alone_fits = math.floor((SLO_HEADROOM * 0.02 - OVERHEAD_S) / PER_ITEM_S)
    assert adaptive.max_units(policy, interactive, now - 1.0, now, 200) == alone_fits


def test_fill_leaves_room_for_the_lower_class_batch_a_request_may_have_waited_for() -> None:
    classes = (ClassPolicy("interactive", slo_s=0.02), ClassPolicy("background", slo_s=30.0))
    policy = _policy(max_batch_size=128, classes=classes, default_class="background", slo_s=None)
    adaptive = Adaptive(_fit())
    interactive = policy.class_limits("interactive")
    background = policy.class_limits("background")
    now = 5.0
    # Neither class has traffic, then only the interactive one: no background batch
    # was capped for it, or none ran; it waited for nothing unseen.
    assert adaptive.max_units(policy, interactive, now, now) == 46
    _steady(adaptive, "interactive", 50, until_s=now)
    assert adaptive.max_units(policy, interactive, now, now) == 46
    _steady(adaptive, "background", 2000, until_s=now)
    lower = adaptive.max_units(policy, background, now, now)
    # Read just now: computing on the event loop, the model kept it unread for up to a
    # whole background batch; that batch and its own must fit its budget together.
    fill = adaptive.max_units(policy, interactive, now, now)
    assert (OVERHEAD_S + PER_ITEM_S * lower) + (OVERHEAD_S + PER_ITEM_S * fill) <= 0.016 + 1e-12
    assert fill == 1
    assert adaptive.max_units(policy, interactive, now, now, num_own_units=3) == 3  # never cut


def test_auto_is_accepted_per_model_and_per_class_and_anything_else_named() -> None:
    policy = BatchPolicy(
        max_delay_s=0.002,
        classes=(ClassPolicy("a", max_delay_s="auto"), ClassPolicy("b")),
        default_class="b",
    )
    assert policy.class_limits("a").is_auto_delay
    assert not policy.class_limits("b").is_auto_delay
    assert policy.is_adaptive
    with pytest.raises(ConfigError, match=r'max_delay_s.*"auto"'):
        BatchPolicy(max_delay_s="soon")
    with pytest.raises(ConfigError, match=r'max_batch_size.*"auto"'):
        BatchPolicy(max_batch_size="big")
    with pytest.raises(ConfigError, match=r"classes\['a'\].max_delay_s"):
        ClassPolicy("a", max_delay_s="later")
    with pytest.raises(ConfigError, match="slo_s"):
        BatchPolicy(slo_s=0)


def test_the_model_slo_is_inherited_by_classes_without_one_and_by_the_defaults() -> None:
    assert BatchPolicy(slo_s=0.05).class_limits("interactive").slo_s == 0.05
    mine = (ClassPolicy("a", slo_s=0.01), ClassPolicy("b"))
    policy = BatchPolicy(slo_s=0.05, classes=mine, default_class="b")
    assert policy.class_limits("a").slo_s == 0.01
    assert policy.class_limits("b").slo_s == 0.05


# -- bounds, for any line, rate and queue ---------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    overhead_s=st.floats(0.0, 0.05),
    per_item_s=st.floats(0.0, 0.01),
    rate_rps=st.floats(0.5, 50_000),
    num_items=st.integers(1, 300),
    waited_s=st.floats(0.0, 0.5),
    slo_s=st.none() | st.floats(0.001, 2.0),
    max_batch_size=st.sampled_from([1, 8, 64, "auto"]),
)
def test_it_never_exceeds_its_budget_nor_the_size_caps(
    overhead_s: float,
    per_item_s: float,
    rate_rps: float,
    num_items: int,
    waited_s: float,
    slo_s: float | None,
    max_batch_size: int | str,
) -> None:
    adaptive = Adaptive(_fit(overhead_s, per_item_s))
    policy = _policy(max_batch_size=max_batch_size, slo_s=slo_s)
    limits = policy.class_limits(None)
    now = 10.0
    adaptive.arrived(limits.name, now - 5.0, False)
    _steady_until(adaptive, limits.name, rate_rps, now)
    oldest_s = now - waited_s
    max_items = adaptive.max_units(policy, limits, oldest_s, now)
    assert 1 <= max_items <= limits.max_batch_size
    num_items = min(num_items, max_items)
    due = adaptive.due_s(limits, num_items, max_items, oldest_s, now)
    target = adaptive.target_size(limits, max_items, now)
    assert 1 <= target <= max_items
    budget_s = adaptive.budget_s(limits, target)
    assert budget_s <= MAX_AUTO_DELAY_S
    assert due <= max(now, oldest_s + budget_s) + 1e-9


def _steady_until(adaptive: Adaptive, name: str, rate_rps: float, now: float) -> None:
    """Arrivals at ``rate_rps`` over the 5 s before ``now`` (at most 20 000 of them, the
    rest counted in bulk at the same instants)."""
    num = int(5.0 * rate_rps)
    steps = min(num, 20_000)
    for i in range(steps):
        adaptive.arrived(name, now - 5.0 + 5.0 * (i + 1) / steps, True, num // steps)


# -- in a simulated serving loop ------------------------------------------------------


@dataclass
class _Sim:
    """One replica, one class, a noisy model ``t(b) = a + c b`` (x U[1-noise, 1+noise]),
    Poisson arrivals whose rate may step; the controller decides at each event."""

    rate_of: object  # Callable[[float], float]: rate at time t
    noise: float = 0.3
    seed: int = 1
    policy: BatchPolicy = field(default_factory=lambda: _policy(max_batch_size=128))
    fit: BatchTimeFit = field(default_factory=BatchTimeFit)
    sizes: list[tuple[float, int]] = field(default_factory=list)
    samples: list[tuple[float, float, int]] = field(default_factory=list)

    def run(self, until_s: float, sample_every_s: float = 0.25) -> Adaptive:
        rng = random.Random(self.seed)
        adaptive = Adaptive(self.fit)
        limits = self.policy.class_limits(None)
        queue: deque[float] = deque()
        now, busy_until, next_sample = 0.0, 0.0, sample_every_s
        next_arrival = rng.expovariate(self.rate_of(0.0))  # type: ignore[operator]
        due = math.inf
        running = 0  # the items of the batch computing until busy_until
        while now < until_s:
            now = min(next_arrival, busy_until if busy_until > now else math.inf, due)
            now = max(now, 0.0)
            if running and now >= busy_until:  # the batch landed: its answers left
                adaptive.answered(busy_until, {limits.name: running})
                running = 0
            if now >= next_sample:
                state = adaptive.state(self.policy, now)
                (mine,) = [c for c in state.classes if c.name == limits.name]
                self.samples.append((now, mine.delay_s, mine.batch_size))
                next_sample += sample_every_s
            if now == next_arrival:
                adaptive.arrived(limits.name, now, bool(queue))
                queue.append(now)
                next_arrival = now + rng.expovariate(self.rate_of(now))  # type: ignore[operator]
            due = math.inf
            if busy_until > now or not queue:
                continue
            max_items = adaptive.max_units(self.policy, limits, queue[0], now)
            num = min(len(queue), max_items)
            when = adaptive.due_s(limits, num, max_items, queue[0], now)
            if num < max_items and when > now:
                due = when
                continue
            for _ in range(num):
                queue.popleft()
            if not queue:
                adaptive.emptied(limits.name, now)
            compute_s = (OVERHEAD_S + PER_ITEM_S * num) * rng.uniform(
                1 - self.noise, 1 + self.noise
            )
            self.fit.observe(num, compute_s)
            self.sizes.append((now, num))
            busy_until, running = now + compute_s, num
        return adaptive


def test_the_chosen_delay_settles_under_a_noisy_model() -> None:
    sim = _Sim(rate_of=lambda t: 1500.0)
    sim.run(until_s=20.0)
    late = [(d, b) for t, d, b in sim.samples if t >= 12.0]
    delays = [d for d, _ in late]
    targets = [b for _, b in late]
    assert min(targets) >= 1
    # No flapping between extremes (at once / the whole budget): over the last 8 s the
    # target size stays within a factor 1.5 and the window a lone request gets within
    # half of its median either way.
    assert max(targets) <= 1.5 * min(targets)
    median = sorted(delays)[len(delays) // 2]
    assert all(0.5 * median <= d <= 1.5 * median for d in delays)
    assert median > 0  # at this rate waiting pays: it does wait


def test_open_loop_traffic_is_not_taken_for_a_closed_loop() -> None:
    adaptive = _Sim(rate_of=lambda t: 1500.0).run(until_s=10.0)
    assert adaptive.closed_loop_share(_policy().class_limits(None).name) < CLOSED_LOOP_SHARE / 2


def _closed_loop(num_clients: int, until_s: float, seed: int = 2) -> tuple[list[int], list[float]]:
    """``num_clients`` clients that each send again 0.2-1 ms after their answer, to one
    replica of a noisy ``t(b) = a + c b``; the sizes of the batches it sent, and how long
    each batch's oldest request had waited when it went."""
    rng = random.Random(seed)
    policy = _policy()
    limits = policy.class_limits(None)
    fit = BatchTimeFit()
    adaptive = Adaptive(fit)
    sends = [rng.uniform(0.0002, 0.001) for _ in range(num_clients)]
    heapq.heapify(sends)
    queue: deque[float] = deque()
    sizes: list[int] = []
    waits: list[float] = []
    now, landing_s, running, due = 0.0, math.inf, 0, math.inf
    while now < until_s:
        now = min(sends[0] if sends else math.inf, landing_s, due)
        if now == landing_s:
            adaptive.answered(now, {limits.name: running})
            for _ in range(running):
                heapq.heappush(sends, now + rng.uniform(0.0002, 0.001))
            landing_s, running = math.inf, 0
        elif sends and now == sends[0]:
            heapq.heappop(sends)
            adaptive.arrived(limits.name, now, bool(queue))
            queue.append(now)
        due = math.inf
        if running or not queue:
            continue
        max_items = adaptive.max_units(policy, limits, queue[0], now)
        num = int(min(len(queue), max_items))
        when = adaptive.due_s(limits, num, max_items, queue[0], now)
        if num < max_items and when > now:
            due = when
            continue
        waits.append(now - queue[0])
        for _ in range(num):
            queue.popleft()
        if not queue:
            adaptive.emptied(limits.name, now)
        compute_s = (OVERHEAD_S + PER_ITEM_S * num) * rng.uniform(0.9, 1.1)
        fit.observe(num, compute_s)
        sizes.append(num)
        landing_s, running = now + compute_s, num
    return sizes, waits


def test_a_closed_loop_of_64_clients_rides_in_batches_of_nearly_64() -> None:
    """Sized by the rate alone, 64 clients that come straight back settle in alternating
    batches of about half (each batch's time brings the other half back): the target
    size is self-consistent. The controller sees them come back and waits for them."""
    sizes, _ = _closed_loop(num_clients=64, until_s=5.0)
    late = sizes[len(sizes) // 2 :]
    assert sum(late) / len(late) > 0.9 * 64


def test_one_closed_loop_client_is_never_kept_waiting() -> None:
    """Its one request is back: nothing more is pending, so it goes at once (once warm)."""
    _, waits = _closed_loop(num_clients=1, until_s=1.0)
    assert len(waits) > 100
    assert max(waits[COLD_BATCHES:]) == 0.0


def test_it_follows_a_step_in_the_arrival_rate_within_a_few_seconds() -> None:
    sim = _Sim(rate_of=lambda t: 100.0 if t < 10.0 else 2000.0)
    sim.run(until_s=20.0)
    before = [b for t, _, b in sim.samples if 5.0 <= t < 10.0]
    settled = [b for t, _, b in sim.samples if t >= 16.0]
    after_3s = [b for t, _, b in sim.samples if 13.0 <= t < 13.5]
    assert max(before) == 1  # 100 rps: every request goes alone, at once
    assert min(settled) > 4
    assert min(after_3s) >= 0.75 * min(settled)  # most of the way there within 3 s
    mean_after = sum(n for t, n in sim.sizes if t >= 16.0) / sum(
        1 for t, _ in sim.sizes if t >= 16.0
    )
    assert mean_after > 4  # and the batches it sends grew with it


# -- through the scheduler ------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    overhead_s=st.floats(0.0, 0.02),
    per_item_s=st.floats(0.0, 0.002),
    rates=st.tuples(st.floats(0.0, 5000), st.floats(0.0, 5000)),
    arrivals=st.lists(
        st.tuples(st.integers(0, 1), st.integers(1, 4), st.floats(0.0, 0.05), st.floats(0.1, 3)),
        min_size=1,
        max_size=60,
    ),
    max_batch_size=st.sampled_from([4, 16, "auto"]),
    max_batch_cost=st.none() | st.floats(4.0, 40.0),
    fill_from_lower=st.booleans(),
)
def test_batches_it_closes_keep_max_batch_size_and_max_batch_cost(
    overhead_s: float,
    per_item_s: float,
    rates: tuple[float, float],
    arrivals: list[tuple[int, int, float, float]],
    max_batch_size: int | str,
    max_batch_cost: float | None,
    fill_from_lower: bool,
) -> None:
    classes = (ClassPolicy("hi", slo_s=0.02), ClassPolicy("lo", max_delay_s="auto"))
    policy = BatchPolicy(
        max_batch_size=max_batch_size,
        max_delay_s="auto",
        max_batch_cost=max_batch_cost,
        classes=classes,
        default_class="lo",
        fill_from_lower=fill_from_lower,
        slo_s=0.5,
    )
    adaptive = Adaptive(_fit(overhead_s, per_item_s))
    now = 10.0
    for name, rate_rps in zip(("hi", "lo"), rates, strict=True):
        if rate_rps > 0:
            _steady_until(adaptive, name, rate_rps, now)
    loop = asyncio.new_event_loop()
    try:
        queues = Queues(policy)
        for i, (rank, num_items, age_s, cost) in enumerate(sorted(arrivals, key=lambda a: -a[2])):
            limits = policy.limits[("hi", "lo")[rank]]
            if max_batch_cost is not None:
                cost = min(cost * num_items, max_batch_cost)
            num_items = min(num_items, limits.max_batch_size)
            queues.admit(
                Request(
                    i,
                    None,
                    num_items,
                    num_items > 1,
                    cost,
                    limits.name,
                    limits.rank,
                    now - age_s,
                    None,
                    loop.create_future(),
                )
            )
        heads = {q.name: q.head() for q in queues.ordered}
        unit = policy.budget_unit  # the caps count cost under max_batch_cost
        own = {
            q.name: q.live_cost if unit == UNIT_COST else q.num_live_items for q in queues.ordered
        }
        caps = {
            n: adaptive.max_units(policy, policy.limits[n], h.arrival_s, now, own[n])
            for n, h in heads.items()
            if h is not None
        }
        decision = _decide(now, policy, queues, adaptive)
    finally:
        loop.close()
    batch = decision.batch
    if batch is None:
        assert decision.wake_at_s is not None and decision.wake_at_s > now
        oldest = min(h.arrival_s for h in heads.values() if h is not None)
        assert decision.wake_at_s <= oldest + MAX_AUTO_DELAY_S + 1e-9
        return
    lead = policy.limits[batch.lead_class]
    if len(batch.requests) > 1:  # a lone oversized request runs alone rather than never
        assert batch.num_items <= lead.max_batch_size
        if max_batch_cost is not None:
            assert batch.cost <= min(max_batch_cost, caps[batch.lead_class]) + 1e-9
        else:
            assert batch.num_items <= caps[batch.lead_class]


# -- in the budget's unit -------------------------------------------------------------


def _token_queues(policy: BatchPolicy, lengths: list[int], now: float) -> Queues:
    queues = Queues(policy)
    limits = policy.limits[policy.default_class]
    loop = asyncio.new_event_loop()
    try:
        for i, length in enumerate(lengths):
            request = Request(
                i, None, 1, False, 1.0, limits.name, limits.rank, now, None, loop.create_future()
            )
            request.num_tokens = request.length = length
            queues.admit(request)
    finally:
        loop.close()
    return queues


@pytest.mark.parametrize(
    ("max_batch_size", "slo_s", "expected_tokens"),
    [
        # The knee in tokens: overhead / (KNEE_SHARE * per_token) = 2,000 tokens.
        ("auto", None, 2000),
        # Within the budget: (0.8 * 50 ms - 2 ms) / 10 us = 3,800 tokens, so 7 of 500.
        (64, 0.05, 3500),
    ],
)
def test_under_a_token_budget_it_caps_batches_in_tokens(
    max_batch_size: int | str, slo_s: float | None, expected_tokens: int
) -> None:
    """An embeddings batch's time follows its tokens, not its items: the line is fitted
    and the caps are applied in tokens. Counted in items, 3,800 (or the 2,000-item knee)
    would let the 4,096-token budget take 8 requests of 500 tokens: 80 ms, past a 50 ms
    SLO."""
    policy = BatchPolicy(
        max_batch_size=max_batch_size, max_delay_s="auto", max_batch_tokens=4096, slo_s=slo_s
    )
    assert policy.budget_unit == "tokens"
    adaptive = Adaptive(_fit(overhead_s=0.002, per_item_s=1e-5))  # a line in tokens
    now = 10.0
    _steady(adaptive, policy.default_class, 50.0, now)
    queues = _token_queues(policy, [500] * 20, now)
    decision = _decide(now, policy, queues, adaptive)
    assert decision.batch is not None
    assert decision.batch.units == expected_tokens
    assert len(decision.batch.requests) == expected_tokens // 500
    state = adaptive.state(policy, now)
    assert state.unit == "tokens"
    assert state.per_item_s == pytest.approx(1e-5)


def test_its_rates_count_the_unit_and_a_request_its_mean_size() -> None:
    adaptive = Adaptive(_fit())
    for i in range(200):
        adaptive.arrived("normal", i * 0.01, True, units=300.0)
    assert adaptive.rate_rps("normal", 2.0) == pytest.approx(100.0, rel=0.05)
    assert adaptive.company_rps("normal", 2.0) == pytest.approx(30_000.0, rel=0.05)
    assert adaptive.request_units("normal", 2.0) == pytest.approx(300.0)


def _choice(state: AdaptiveState, name: str) -> ClassChoice:
    return next(c for c in state.classes if c.name == name)


def _unit_fit(overhead_s: float, per_unit_s: float, sizes: list[float]) -> BatchTimeFit:
    fit = BatchTimeFit()
    for size in sizes * 3:
        fit.observe(size, overhead_s + per_unit_s * size)
    return fit


def test_a_lone_request_of_under_one_unit_goes_at_once_at_low_load() -> None:
    """Was: the target had a floor of one unit (four requests of cost 0.25), and the gap
    rule read the unit rate as requests: a lone request waited 30 ms at 22% load."""
    policy = BatchPolicy(max_delay_s="auto", max_batch_cost=16.0, slo_s=0.05)
    limits = policy.class_limits(None)
    adaptive = Adaptive(_unit_fit(0.002, 0.001, [0.25, 0.5, 1, 2, 4, 8]))
    for i in range(501):  # 100 requests a second of 0.25 each
        adaptive.arrived(limits.name, i / 100, True, units=0.25)
    now = 5.0
    assert adaptive.target_size(limits, 16.0, now) == pytest.approx(0.25)
    assert adaptive.due_s(limits, 0.25, 16.0, now, now) == now


def test_requests_of_under_one_unit_go_at_once_only_if_one_at_a_time_keeps_up() -> None:
    """The low-load shortcut tested r t(one) <= rho where the rule is r t(b) / b <= rho:
    8 requests a second of cost 0.25 at t(b) = 0.2 + 0.01 b were sent one at a time,
    162% of the replica."""
    target = _keep_up_size(2.0, 0.2, 0.01, 64.0, 0.25)
    assert 2.0 * (0.2 + 0.01 * target) / target <= TARGET_UTILIZATION
    assert _keep_up_size(2.0, 0.2, 0.01, 64.0, 1.0) == 1.0  # a request of one unit: as ever


def test_under_tokens_a_request_shorter_than_the_mean_goes_at_once_at_low_load() -> None:
    """Was: the target's floor is the mean request (66 tokens), so at 7 texts a second a
    text of 20 tokens waited for company up to its budget (66 ms here), where requests
    one at a time keep up; the embeddings sweep's Poisson 30% point had a mean queue wait
    of 43 ms against 8-15 for every fixed window."""
    policy = BatchPolicy(max_delay_s="auto", max_batch_tokens=8192, slo_s=0.1)
    limits = policy.class_limits(None)
    adaptive = Adaptive(_unit_fit(0.0075, 0.0004, [20, 66, 112, 224, 448]))
    for i in range(36):  # 7 a second, 20 and 112 tokens in turn
        adaptive.arrived(limits.name, i / 7, True, units=(20.0, 112.0)[i % 2])
    now = 35 / 7 + 0.001
    assert adaptive.target_size(limits, 8192.0, now) > 20
    assert adaptive.due_s(limits, 20.0, 8192.0, now, now) == now


def test_under_tokens_the_gap_rule_counts_requests_not_tokens() -> None:
    """Was: two mean gaps read as 2 / (tokens per second), 0.07 ms at 100 requests a second
    of 300 tokens, where two gaps between requests are 20 ms."""
    policy = BatchPolicy(max_delay_s="auto", max_batch_tokens=8192, slo_s=0.5)
    limits = policy.class_limits(None)
    adaptive = Adaptive(_unit_fit(0.008, 0.00005, [300, 600, 1200, 2400, 4800]))
    for i in range(501):
        adaptive.arrived(limits.name, i / 100, True, units=300.0)
    now = 5.0
    target = adaptive.target_size(limits, 8192.0, now)
    assert target > 300  # at this rate waiting for company pays
    assert adaptive.due_s(limits, 300.0, 8192.0, now, now) - now == pytest.approx(0.02)


def test_the_reported_window_is_never_negative_nor_its_target_past_the_cap() -> None:
    """Was: with max_batch_cost 0.5 the target stayed at one unit, over the cap, and the
    reported window (target - 1) / rate went negative."""
    policy = BatchPolicy(max_delay_s="auto", max_batch_cost=0.5, slo_s=0.05)
    limits = policy.class_limits(None)
    adaptive = Adaptive(_unit_fit(0.002, 0.001, [0.1, 0.2, 0.3, 0.4, 0.5]))
    for i in range(1001):
        adaptive.arrived(limits.name, i / 200, True, units=0.1)
    choice = _choice(adaptive.state(policy, 5.0), limits.name)
    assert choice.delay_s >= 0.0 and choice.batch_size <= choice.max_batch_size


def test_the_reported_window_does_not_grow_once_the_traffic_has_gone() -> None:
    """Was: a target held from a burst divided by the decaying rate: 5 ms reported during
    it, 37 ms a second after, while a lone request then went at once."""
    policy = _policy()
    limits = policy.class_limits(None)
    adaptive = Adaptive(_fit())
    for i in range(10_001):  # 2000 a second for 5 s
        adaptive.arrived(limits.name, i / 2000, True)
        if i % 100 == 0:
            adaptive.due_s(limits, 1, 64, i / 2000, i / 2000)
    during = _choice(adaptive.state(policy, 5.0), limits.name)
    assert during.delay_s > 0  # at this rate it waits for company
    for later_s in (5.5, 6.0):  # what a lone request arriving then gets: two gaps at most
        after = _choice(adaptive.state(policy, later_s), limits.name)
        assert after.delay_s <= GAP_FACTOR / after.company_rate_rps + 1e-9, (later_s, after)
    assert _choice(adaptive.state(policy, 8.0), limits.name).delay_s == 0.0  # at once
