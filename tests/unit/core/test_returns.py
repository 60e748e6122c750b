"""``carpool.core.returns``: a class whose answered requests come straight back is told
from open-loop traffic, and what of its last batch is still on its way."""

from __future__ import annotations

import random

from carpool.core.returns import CLOSED_LOOP_SHARE, RETURN_WINDOW_S, Returns


def _closed_loop(returns: Returns, num_batches: int, size: int, cycle_s: float) -> float:
    """``num_batches`` batches of ``size`` landing every ``cycle_s``, each request back
    within a millisecond of its answer; returns the time of the last landing."""
    rng = random.Random(0)
    now = 0.0
    for _ in range(num_batches):
        returns.answered(now, size)
        for back_s in sorted(rng.uniform(0.0001, 0.001) for _ in range(size)):
            returns.arrived(now + back_s, 1)
        now += cycle_s
    return now - cycle_s


def test_a_closed_loop_is_recognised_and_its_pending_clients_counted() -> None:
    returns = Returns()
    last_s = _closed_loop(returns, num_batches=20, size=32, cycle_s=0.010)
    assert returns.share > 0.95
    # The last batch's 32 all came back: nothing pending. A new landing: all 32 pending
    # until they arrive, and nothing once the window has closed.
    assert returns.pending(last_s + 0.002) == 0.0
    now = last_s + 0.010
    returns.answered(now, 32)
    assert returns.pending(now) > 30
    for i in range(10):
        returns.arrived(now + 0.0001 * (i + 1), 1)
    assert 20 < returns.pending(now + 0.0011) < 23
    assert returns.window_end_s == now + RETURN_WINDOW_S
    assert returns.pending(now + RETURN_WINDOW_S + 1e-6) == 0.0


def test_open_loop_arrivals_are_not_taken_for_returning_clients() -> None:
    """Poisson arrivals at 3000/s, as dense in the windows after each landing as between
    them: the share stays near 0 and nothing is ever pending."""
    rng = random.Random(1)
    returns = Returns()
    now, next_landing, size = 0.0, 0.0, 0
    while now < 5.0:
        now += rng.expovariate(3000.0)
        while next_landing <= now:
            returns.answered(next_landing, max(size, 1))
            next_landing += 0.012
            size = 0
        returns.arrived(now, 1)
        size += 1
        assert returns.pending(now) == 0.0
    assert returns.share < CLOSED_LOOP_SHARE / 2


def test_the_share_falls_when_the_clients_stop_coming_back() -> None:
    returns = Returns()
    last_s = _closed_loop(returns, num_batches=20, size=32, cycle_s=0.010)
    now = last_s
    for _ in range(6):  # the loop stopped: batches land, nobody comes back
        now += 0.010
        returns.answered(now, 32)
    assert returns.share < CLOSED_LOOP_SHARE
    assert returns.pending(now) == 0.0
