"""Idle replica loops, least busy lately first (``carpool.core.idle``): the order waiters
come out in, and a replica's decayed busy time as a key."""

from __future__ import annotations

import asyncio
import math

import pytest

from carpool.core.idle import BUSY_DECAY_S, BusyTime, IdleReplicas


async def test_idle_replicas_give_the_lowest_key_first_and_skip_dropped_waiters() -> None:
    loop = asyncio.get_running_loop()
    idle = IdleReplicas()
    waiters = [loop.create_future() for _ in range(4)]
    for waiter, key in zip(waiters, [0.5, float("-inf"), 0.5, -1.0], strict=True):
        idle.push(waiter, key)
    idle.drop(waiters[3])
    assert len(idle) == 3
    # Never busy first, then equal keys in the order they were pushed.
    assert [idle.take() for _ in range(4)] == [waiters[1], waiters[0], waiters[2], None]
    assert not idle


def test_busy_time_keys_order_replicas_as_their_decayed_busy_times_do() -> None:
    """A replica that computed 1 s up to t=10 is busier at any later time than one that
    computed 0.5 s up to t=10.5, by e^(-0.5) = 0.61 against 0.5; keys set at different
    times compare as those decayed totals do, without an update while idle."""
    busier, lighter, never = BusyTime(), BusyTime(), BusyTime()
    busier.add(10.0, 1.0)
    lighter.add(10.5, 0.5)
    assert never.key == -math.inf
    assert lighter.key < busier.key
    assert busier.busy_s == pytest.approx(1.0)
    busier.add(10.5, 0.0)  # decayed to 10.5: now comparable directly
    assert busier.busy_s == pytest.approx(math.exp(-0.5 / BUSY_DECAY_S))
    assert busier.busy_s > lighter.busy_s
